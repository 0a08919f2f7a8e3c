"""The command line: click only. Each command parses, calls one pipeline function, renders."""
