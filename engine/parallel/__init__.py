"""Tensor-parallel ranks: ``tp_group`` (the driver's group of rank processes), ``tp_follower`` (a rank's command loop),
``step_wire`` (a step's host ints for the ranks), ``nccl_errors``, and ``device_threads`` (every thread enters its
device first)."""
