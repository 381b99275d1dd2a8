"""NCCL all-reduce time and bus bandwidth between the GPUs of one host, at the sizes of
ResNet-50's gradients (bf16 and fp32) and one small message.

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node=2 tools/allreduce_bw.py

Add NCCL_DEBUG=INFO to see the transport NCCL picked (P2P, SHM, ...)."""
import time

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    for n, dtype in ((25_557_032, torch.bfloat16), (25_557_032, torch.float32), (1 << 20, torch.float32)):
        x = torch.ones(n, dtype=dtype, device="cuda")
        for _ in range(5):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        k, t = 20, time.perf_counter()
        for _ in range(k):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        sec = (time.perf_counter() - t) / k
        size = n * x.element_size()
        if rank == 0:
            algbw = size / sec / 1e9
            print(f"allreduce {size / 2**20:8.1f} MiB {str(dtype).split('.')[-1]:9s} {sec * 1e3:7.3f} ms  "
                  f"algbw {algbw:7.1f} GB/s  busbw {algbw * 2 * (world - 1) / world:7.1f} GB/s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
