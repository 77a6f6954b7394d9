"""The analysis side: table readers, figures by topic, one plotting style, the figure
registry, the claims table and the HTML report, all drawn from results/tables only."""
