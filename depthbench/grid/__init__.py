"""The config grid: loading, validation against the schema and the data it names, expansion into
run specs."""
