"""Across the processes of one host, no server: keyed locks on kernel record locks over the
files of one directory that every process names."""
