// TRAINER_HD marks functions compiled for both host and device, so the CPU
// kernels and the CUDA kernels run the same math (docs/architecture.md "Devices").
#pragma once

#if defined(__CUDACC__)
#define TRAINER_HD __host__ __device__ __forceinline__
#else
#define TRAINER_HD inline
#endif
