"""The preflight (issue 27, docs/preflight.md): measure a cluster's GPUs and network before a
paid run, judge the figures against a reference table and the cluster's median, and stop a
launch whose cluster fails. The node side is cloudtrain/node/preflight.py.

report.py, verdict.py and reference.py use the standard library only, so that
bench/gpu_preflight.sh can judge a GPU machine's figures with nothing of ours installed."""
