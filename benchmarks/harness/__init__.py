"""What every benchmark shares, so that a driver only declares what it compares.

* :mod:`harness.cluster`: an emulated multi-node cluster (network namespaces, a ``tc``-shaped link)
  and the launch of one worker per rank inside it;
* :mod:`harness.jobs`: ``torch.distributed.run`` jobs on the local machine, the marker-file handshake with a
  job's rank 0, and the host-load checks (wait for an idle host, rerun a disturbed job);
* :mod:`harness.cli`: the command-line options the drivers have in common;
* :mod:`harness.report`: result tables, JSON results and figures;
* :mod:`harness.worker`: what the worker processes share (needs torch and Lightning).
"""
