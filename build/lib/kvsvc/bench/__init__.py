"""`kvsvc bench`: kvsvc Transfer vs raw NIXL on the same descriptors vs memcpy, in one run.

measure: statistics, CPU time, progress; paths: the ways bytes are moved and timed;
sweep: the run itself (servers, sizes, concurrency, cold vs warm); report: the table and
JSON; plots: PNG charts.
"""
