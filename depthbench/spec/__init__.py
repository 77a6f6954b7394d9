"""What one run is: the config schema and its defaults, width/depth shapes at a budget, the
training recipe and the run spec that hashes to a run id."""
