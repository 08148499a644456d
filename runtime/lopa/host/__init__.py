"""Host tuning for CPU inference: the process heap, the OpenMP thread pools, the CPU threads torch
may run. Below every other room of the runtime: the model and the executors both use it.

heap        keep freed memory in the process heap (glibc's malloc thresholds)
openmp      one OpenMP thread pool per process: the loading thread hands its pool back
cpu_budget  the CPU threads torch may run (a container's CPU quota included)
device      the device `auto` means on this machine: CUDA, then an Ascend NPU, else the CPU
"""
