"""Tensor parallelism over torch.distributed (NCCL on GPUs, gloo on CPU): a target split over
ranks, one worker process per further device, rank 0 scheduling for all (docs/ARCHITECTURE.md,
"Several devices").

group.py    the group, its collectives (data: NCCL / gloo; control: gloo)
layers.py   where the ranks meet: row-parallel linear, vocab-parallel embedding and LM head, the MoE reduce
shard.py    the local config, the meeting layers put in, which slice of each checkpoint tensor a rank reads
loading.py  a rank's share of a checkpoint, read by slices
runner.py   the step on every rank: StepPlan, LeaderRunner (rank 0), WorkerRunner
launch.py   spawning or joining the ranks, the watchdog, the worker loop
"""
