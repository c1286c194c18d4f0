from torchtitan.distributed.parallel_dims import ParallelDims, ParallelismConfigError

__all__ = ["ParallelDims", "ParallelismConfigError"]
