// CHECK macros for the CUDA libraries: print rank, file:line, the call and
// the library's message, then abort (core/check.h).
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include "core/check.h"

#define CUDA_CHECK(call)                                                          \
  do {                                                                            \
    cudaError_t err_ = (call);                                                    \
    if (err_ != cudaSuccess)                                                      \
      ::trainer::check_fail(__FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
  } while (0)

#define CUDNN_CHECK(call)                                                         \
  do {                                                                            \
    cudnnStatus_t st_ = (call);                                                   \
    if (st_ != CUDNN_STATUS_SUCCESS)                                              \
      ::trainer::check_fail(__FILE__, __LINE__, #call, cudnnGetErrorString(st_)); \
  } while (0)

#define CUBLAS_CHECK(call)                                                          \
  do {                                                                              \
    cublasStatus_t st_ = (call);                                                    \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                               \
      ::trainer::check_fail(__FILE__, __LINE__, #call, cublasGetStatusString(st_)); \
  } while (0)
