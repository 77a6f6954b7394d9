"""`depthbench rehearse`: one step of each planned job, measured (time, peak memory)."""
