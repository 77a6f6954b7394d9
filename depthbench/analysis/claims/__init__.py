"""The claims of the source papers, checked on our tables: the verdicts and the registry of claim
functions (verdict), the claims by topic (depth, representations, dynamics, cost_nll) and the
claims table they make (table)."""
