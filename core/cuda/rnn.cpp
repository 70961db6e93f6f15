// CUDA LSTM and GRU layers on cuDNN's RNN API (cudnn_adv.h): cudnnRNNForward,
// cudnnRNNBackwardData_v8 and cudnnRNNBackwardWeights_v8 over one
// unidirectional layer, data batch-major ([B, T, I] as the op passes it),
// every sequence of length T.
//
// Gate orders. cuDNN's LSTM linear layers 0-3 (input side W) and 4-7
// (recurrent side R) are the input, forget, new-memory and output gates:
// PyTorch's i, f, g, o. Its GRU's 0-2 and 3-5 are the reset, update and
// new-memory gates with h' = tanh(W_h x + b_Wh + r (R_h h + b_Rh)):
// PyTorch's r, z, n in the linear-before-reset form. So row block k of
// PyTorch's weight_ih [G H, I] is cuDNN's matrix k ([H, I], row-major, the
// same memory), block k of weight_hh is matrix G + k, and slice k of a
// bias [G H] is the matching bias vector.
// Biases: CUDNN_RNN_DOUBLE_BIAS. The GRU binds bias_ih and bias_hh; the LSTM
// gets the op's summed bias as its W biases and zero R biases, and grad_bias
// is the gradient of the W biases (b_W and b_R receive the same one).
//
// Set up once per (device, cell, dtype, B, T, I, H) and cached: the RNN and
// data descriptors, the sizes of weight space, workspace and reserve space,
// the byte offset of every matrix and bias in the weight space
// (cudnnGetRNNWeightParams), and the device array of sequence lengths the
// v8 calls read. Per call: copy the weights into a weight space, run, and
// when training return the record, one u8 tensor holding the weight space
// then the reserve space: the backward runs on the very weights and reserve
// of its forward. Workspaces come from the caching allocator. cuDNN's
// backward data rewrites the reserve space, so a record serves one backward:
// a second one (autograd's retain_graph) is an Error (ConsumedRecords).
//
// dtypes: f32 (cuDNN's default math: TF32 tensor cores where the GPU has
// them, as the matmul), f16 (f32 math, tensor cores), f64. bf16 runs on f32
// copies: cuDNN's RNN documents half, float and double data only.
//
// One cuDNN handle per device; its stream is set per call under a mutex
// held for the call (the calls only enqueue).
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "core/cuda/consumed_records.h"
#include "core/cuda/cuda_backend.h"
#include "core/cuda/cuda_check.h"
#include "core/cuda/kernel_scope.h"

namespace trainer::cuda {

namespace {

enum class Cell { lstm, gru };

constexpr size_t kAlign = 256;  // of the reserve space inside the record

size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

int as_int(int64_t v, const char* op) {
  CHECK(v >= 0 && v <= INT32_MAX) << op << ": size " << v << " exceeds cuDNN's int";
  return int(v);
}

// The dtype cuDNN runs a layer of dtype t in.
DType run_dtype(DType t) { return t == DType::bf16 ? DType::f32 : t; }

cudnnDataType_t cudnn_type(DType t) {
  switch (t) {
    case DType::f32:
      return CUDNN_DATA_FLOAT;
    case DType::f64:
      return CUDNN_DATA_DOUBLE;
    case DType::f16:
      return CUDNN_DATA_HALF;
    default:
      throw Error(cat("rnn: cuDNN's RNN does not take ", t));
  }
}

// One layer's descriptors, sizes and weight-space layout.
struct RnnPlan {
  int G = 0;  // gates
  cudnnRNNDescriptor_t rnn = nullptr;
  cudnnDropoutDescriptor_t dropout = nullptr;
  cudnnRNNDataDescriptor_t x_desc = nullptr, y_desc = nullptr;
  cudnnTensorDescriptor_t h_desc = nullptr;  // [1, B, H]: h and c alike
  Tensor seq_lengths;                        // [B] i32 on the device, all T
  size_t weight_bytes = 0, train_work = 0, reserve = 0, infer_work = 0;
  // Byte offsets in the weight space of matrix and bias k: k < G the W
  // side of gate k, k >= G the R side of gate k - G.
  std::vector<size_t> matrix, bias;
  size_t record_bytes() const { return align_up(weight_bytes) + reserve; }
};

struct RnnState {
  std::mutex mu;
  std::map<int, cudnnHandle_t> handles;
  std::map<std::vector<int64_t>, std::unique_ptr<RnnPlan>> plans;
  ConsumedRecords consumed;  // records whose reserve space a backward rewrote
};

RnnState& state() {
  static RnnState* s = new RnnState();  // leaked: used until exit
  return *s;
}

cudnnHandle_t handle_locked(RnnState& s, int device) {
  auto it = s.handles.find(device);
  if (it == s.handles.end()) {
    cudnnHandle_t h;
    CUDNN_CHECK(cudnnCreate(&h));
    it = s.handles.emplace(device, h).first;
  }
  return it->second;
}

// Byte offset of one parameter from cudnnGetRNNWeightParams, checked to
// hold `count` elements.
size_t param_offset(const char* base, void* addr, cudnnTensorDescriptor_t desc, int64_t count) {
  cudnnDataType_t dt;
  int nd = 0, dims[CUDNN_DIM_MAX] = {}, strides[CUDNN_DIM_MAX] = {};
  CUDNN_CHECK(cudnnGetTensorNdDescriptor(desc, CUDNN_DIM_MAX, &dt, &nd, dims, strides));
  int64_t n = 1;
  for (int d = 0; d < nd && d < CUDNN_DIM_MAX; ++d) n *= dims[d];
  CHECK(addr != nullptr && n == count)
      << "rnn: cuDNN weight parameter of " << n << " elements, expected " << count;
  return size_t(static_cast<const char*>(addr) - base);
}

RnnPlan build_plan(cudnnHandle_t h, Cell cell, DType t, int64_t B, int64_t T, int64_t I, int64_t H,
                   Device device) {
  const char* op = cell == Cell::lstm ? "lstm_layer" : "gru_layer";
  RnnPlan p;
  p.G = cell == Cell::lstm ? 4 : 3;
  const cudnnDataType_t dt = cudnn_type(t);
  const cudnnDataType_t math_prec = t == DType::f64 ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT;
  const cudnnMathType_t math = t == DType::f16 ? CUDNN_TENSOR_OP_MATH : CUDNN_DEFAULT_MATH;
  // A dropout descriptor of probability 0 (one layer: cuDNN applies none);
  // with p = 0 it needs no random states.
  CUDNN_CHECK(cudnnCreateDropoutDescriptor(&p.dropout));
  CUDNN_CHECK(cudnnSetDropoutDescriptor(p.dropout, h, 0.0f, nullptr, 0, 0));
  CUDNN_CHECK(cudnnCreateRNNDescriptor(&p.rnn));
  CUDNN_CHECK(cudnnSetRNNDescriptor_v8(
      p.rnn, CUDNN_RNN_ALGO_STANDARD, cell == Cell::lstm ? CUDNN_LSTM : CUDNN_GRU,
      CUDNN_RNN_DOUBLE_BIAS, CUDNN_UNIDIRECTIONAL, CUDNN_LINEAR_INPUT, dt, math_prec, math,
      as_int(I, op), as_int(H, op), as_int(H, op), 1, p.dropout, CUDNN_RNN_PADDED_IO_DISABLED));
  std::vector<int> lengths(size_t(B), as_int(T, op));
  CUDNN_CHECK(cudnnCreateRNNDataDescriptor(&p.x_desc));
  CUDNN_CHECK(cudnnSetRNNDataDescriptor(p.x_desc, dt, CUDNN_RNN_DATA_LAYOUT_BATCH_MAJOR_UNPACKED,
                                        as_int(T, op), as_int(B, op), as_int(I, op), lengths.data(),
                                        nullptr));
  CUDNN_CHECK(cudnnCreateRNNDataDescriptor(&p.y_desc));
  CUDNN_CHECK(cudnnSetRNNDataDescriptor(p.y_desc, dt, CUDNN_RNN_DATA_LAYOUT_BATCH_MAJOR_UNPACKED,
                                        as_int(T, op), as_int(B, op), as_int(H, op), lengths.data(),
                                        nullptr));
  const int h_dims[3] = {1, as_int(B, op), as_int(H, op)};
  const int h_strides[3] = {as_int(B * H, op), as_int(H, op), 1};
  CUDNN_CHECK(cudnnCreateTensorDescriptor(&p.h_desc));
  CUDNN_CHECK(cudnnSetTensorNdDescriptor(p.h_desc, dt, 3, h_dims, h_strides));
  // The lengths the kernels read on the device (copied once, synchronously).
  p.seq_lengths = empty({B}, DType::i32, device);
  CUDA_CHECK(cudaMemcpy(p.seq_lengths.data_ptr(), lengths.data(), lengths.size() * sizeof(int),
                        cudaMemcpyHostToDevice));
  CUDNN_CHECK(cudnnGetRNNWeightSpaceSize(h, p.rnn, &p.weight_bytes));
  CUDNN_CHECK(cudnnGetRNNTempSpaceSizes(h, p.rnn, CUDNN_FWD_MODE_TRAINING, p.x_desc, &p.train_work,
                                        &p.reserve));
  size_t no_reserve = 0;
  CUDNN_CHECK(cudnnGetRNNTempSpaceSizes(h, p.rnn, CUDNN_FWD_MODE_INFERENCE, p.x_desc, &p.infer_work,
                                        &no_reserve));
  // The layout: where each matrix and bias lands in a weight space.
  Tensor space = empty({int64_t(p.weight_bytes)}, DType::u8, device);
  const char* base = static_cast<const char*>(space.data_ptr());
  cudnnTensorDescriptor_t m_desc, b_desc;
  CUDNN_CHECK(cudnnCreateTensorDescriptor(&m_desc));
  CUDNN_CHECK(cudnnCreateTensorDescriptor(&b_desc));
  for (int k = 0; k < 2 * p.G; ++k) {
    void *m_addr = nullptr, *b_addr = nullptr;
    CUDNN_CHECK(cudnnGetRNNWeightParams(h, p.rnn, 0, p.weight_bytes, space.data_ptr(), k, m_desc,
                                        &m_addr, b_desc, &b_addr));
    p.matrix.push_back(param_offset(base, m_addr, m_desc, H * (k < p.G ? I : H)));
    p.bias.push_back(param_offset(base, b_addr, b_desc, H));
  }
  cudnnDestroyTensorDescriptor(m_desc);
  cudnnDestroyTensorDescriptor(b_desc);
  return p;
}

// The cached plan of a layer; call with the state's mutex held.
const RnnPlan& plan_locked(RnnState& s, cudnnHandle_t h, Cell cell, DType t, int64_t B, int64_t T,
                           int64_t I, int64_t H, Device device) {
  std::vector<int64_t> key = {device.index, int64_t(cell), int64_t(t), B, T, I, H};
  auto it = s.plans.find(key);
  if (it == s.plans.end())
    it = s.plans.emplace(key, std::make_unique<RnnPlan>(build_plan(h, cell, t, B, T, I, H, device)))
             .first;
  return *it->second;
}

// t in dtype `run` (itself when it already is; contiguous either way).
Tensor as_run(Backend& be, const Tensor& t, DType run) {
  if (!t.defined() || t.dtype() == run) return t;
  Tensor out = empty(t.shape(), run, t.device());
  be.copy(t, out);
  return out;
}

// An output in dtype `run`: t itself, or a scratch copied back by finish_output.
Tensor run_output(const Tensor& t, DType run) {
  return !t.defined() || t.dtype() == run ? t : empty(t.shape(), run, t.device());
}

void finish_output(Backend& be, const Tensor& scratch, const Tensor& t) {
  if (t.defined() && scratch.impl() != t.impl()) be.copy(scratch, t);
}

void* ptr(const Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

// The PyTorch-layout tensors of a layer's parameters, in the plan's order
// (matrices W then R, biases W then R); undefined biases are zeros in the
// weight space (and get no gradient out of it).
struct Params {
  Tensor weight_ih, weight_hh, bias_w, bias_r;
};

// Copies between a weight space and the PyTorch tensors (dtype `run`):
// block k of each tensor to its parameter's offset, merging blocks adjacent
// on both sides into one copy. to_space: tensors -> space, else back.
void copy_params(const RnnPlan& p, char* space, const Params& params, int64_t I, int64_t H,
                 bool to_space, cudaStream_t stream) {
  struct Block {
    size_t offset;
    char* data;
    size_t bytes;
  };
  std::vector<Block> blocks;
  const size_t es = dtype_size(params.weight_ih.dtype());
  auto add = [&](const Tensor& t, const std::vector<size_t>& offsets, int first, int64_t elems) {
    if (!t.defined()) return;
    for (int g = 0; g < p.G; ++g)
      blocks.push_back({offsets[size_t(first + g)],
                        static_cast<char*>(t.data_ptr()) + size_t(g * elems) * es,
                        size_t(elems) * es});
  };
  add(params.weight_ih, p.matrix, 0, H * I);
  add(params.weight_hh, p.matrix, p.G, H * H);
  add(params.bias_w, p.bias, 0, H);
  add(params.bias_r, p.bias, p.G, H);
  for (size_t i = 0; i < blocks.size();) {
    Block run = blocks[i++];
    while (i < blocks.size() && blocks[i].offset == run.offset + run.bytes &&
           blocks[i].data == run.data + run.bytes)
      run.bytes += blocks[i++].bytes;
    char* dst = to_space ? space + run.offset : run.data;
    const char* src = to_space ? run.data : space + run.offset;
    CUDA_CHECK(cudaMemcpyAsync(dst, src, run.bytes, cudaMemcpyDeviceToDevice, stream));
  }
}

// The operands of one layer call (c0 undefined for the GRU).
struct LayerIo {
  Tensor x, h0, c0, y, h_n, c_n;
};

// y, h_n (, c_n) = the layer over x from h0 (, c0); returns the record when training.
Tensor rnn_forward(Backend& be, Cell cell, cudaStream_t stream, const LayerIo& io,
                   const Params& params, bool training) {
  const DType run = run_dtype(io.x.dtype());
  const int64_t B = io.x.size(0), T = io.x.size(1), I = io.x.size(2), H = io.h0.size(1);
  const Device device = io.x.device();
  const Params rp{as_run(be, params.weight_ih, run), as_run(be, params.weight_hh, run),
                  as_run(be, params.bias_w, run), as_run(be, params.bias_r, run)};
  const Tensor x = as_run(be, io.x, run), h0 = as_run(be, io.h0, run), c0 = as_run(be, io.c0, run);
  const Tensor y = run_output(io.y, run), h_n = run_output(io.h_n, run),
               c_n = run_output(io.c_n, run);
  RnnState& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  cudnnHandle_t h = handle_locked(s, device.index);
  const RnnPlan& p = plan_locked(s, h, cell, run, B, T, I, H, device);
  Tensor record = empty({int64_t(training ? p.record_bytes() : p.weight_bytes)}, DType::u8, device);
  char* space = static_cast<char*>(record.data_ptr());
  if (!rp.bias_r.defined()) CUDA_CHECK(cudaMemsetAsync(space, 0, p.weight_bytes, stream));
  copy_params(p, space, rp, I, H, /*to_space=*/true, stream);
  const size_t work_bytes = training ? p.train_work : p.infer_work;
  Tensor work = empty({int64_t(work_bytes)}, DType::u8, device);
  CUDNN_CHECK(cudnnSetStream(h, stream));
  CUDNN_CHECK(cudnnRNNForward(
      h, p.rnn, training ? CUDNN_FWD_MODE_TRAINING : CUDNN_FWD_MODE_INFERENCE,
      p.seq_lengths.data<int32_t>(), p.x_desc, ptr(x), p.y_desc, ptr(y), p.h_desc, ptr(h0),
      ptr(h_n), p.h_desc, ptr(c0), ptr(c_n), p.weight_bytes, space, work_bytes, ptr(work),
      training ? p.reserve : 0, training ? space + align_up(p.weight_bytes) : nullptr));
  finish_output(be, y, io.y);
  finish_output(be, h_n, io.h_n);
  finish_output(be, c_n, io.c_n);
  return training ? record : Tensor();
}

// The gradients of one layer call (grad_c0 undefined for the GRU).
struct LayerGrads {
  Tensor grad_y, grad_h_n, grad_c_n;  // in
  Tensor grad_x, grad_h0, grad_c0;    // out
};

// Backpropagation through time from the record of rnn_forward: grads of
// the inputs (cudnnRNNBackwardData_v8), then of the parameters into a
// zeroed weight space (cudnnRNNBackwardWeights_v8 adds), copied out to grads.
void rnn_backward(Backend& be, Cell cell, cudaStream_t stream, const LayerIo& io,
                  const Tensor& record, const LayerGrads& g, const Params& grads) {
  const char* op = cell == Cell::lstm ? "lstm_layer backward" : "gru_layer backward";
  const DType run = run_dtype(io.x.dtype());
  const int64_t B = io.x.size(0), T = io.x.size(1), I = io.x.size(2), H = io.h0.size(1);
  const Device device = io.x.device();
  const Tensor x = as_run(be, io.x, run), h0 = as_run(be, io.h0, run), c0 = as_run(be, io.c0, run);
  const Tensor y = as_run(be, io.y, run), dy = as_run(be, g.grad_y, run);
  const Tensor dhy = as_run(be, g.grad_h_n, run), dcy = as_run(be, g.grad_c_n, run);
  const Tensor dx = run_output(g.grad_x, run), dhx = run_output(g.grad_h0, run),
               dcx = run_output(g.grad_c0, run);
  const Params rg{run_output(grads.weight_ih, run), run_output(grads.weight_hh, run),
                  run_output(grads.bias_w, run), run_output(grads.bias_r, run)};
  RnnState& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    cudnnHandle_t h = handle_locked(s, device.index);
    const RnnPlan& p = plan_locked(s, h, cell, run, B, T, I, H, device);
    CHECK(record.defined() && record.dtype() == DType::u8 &&
          size_t(record.numel()) == p.record_bytes())
        << op << ": the record is not from a CUDA training forward of this shape";
    s.consumed.take(record, op);
    char* space = static_cast<char*>(record.data_ptr());
    char* reserve = space + align_up(p.weight_bytes);
    Tensor work = empty({int64_t(p.train_work)}, DType::u8, device);
    Tensor dspace = empty({int64_t(p.weight_bytes)}, DType::u8, device);
    CUDA_CHECK(cudaMemsetAsync(dspace.data_ptr(), 0, p.weight_bytes, stream));
    CUDNN_CHECK(cudnnSetStream(h, stream));
    CUDNN_CHECK(cudnnRNNBackwardData_v8(
        h, p.rnn, p.seq_lengths.data<int32_t>(), p.y_desc, ptr(y), ptr(dy), p.x_desc, ptr(dx),
        p.h_desc, ptr(h0), ptr(dhy), ptr(dhx), p.h_desc, ptr(c0), ptr(dcy), ptr(dcx),
        p.weight_bytes, space, p.train_work, ptr(work), p.reserve, reserve));
    CUDNN_CHECK(cudnnRNNBackwardWeights_v8(
        h, p.rnn, CUDNN_WGRAD_MODE_ADD, p.seq_lengths.data<int32_t>(), p.x_desc, ptr(x), p.h_desc,
        ptr(h0), p.y_desc, ptr(y), p.weight_bytes, dspace.data_ptr(), p.train_work, ptr(work),
        p.reserve, reserve));
    copy_params(p, static_cast<char*>(dspace.data_ptr()), rg, I, H, /*to_space=*/false, stream);
  }
  finish_output(be, dx, g.grad_x);
  finish_output(be, dhx, g.grad_h0);
  finish_output(be, dcx, g.grad_c0);
  finish_output(be, rg.weight_ih, grads.weight_ih);
  finish_output(be, rg.weight_hh, grads.weight_hh);
  finish_output(be, rg.bias_w, grads.bias_w);
  finish_output(be, rg.bias_r, grads.bias_r);
}

}  // namespace

// [i f g o] = x_t W_ih^T + h_{t-1} W_hh^T + bias; c_t = sigmoid(f) c_{t-1}
// + sigmoid(i) tanh(g), h_t = sigmoid(o) tanh(c_t). bias as cuDNN's b_W, b_R = 0.
Tensor CudaBackend::lstm_forward(const Tensor& x, const Tensor& h0, const Tensor& c0,
                                 const Tensor& weight_ih, const Tensor& weight_hh,
                                 const Tensor& bias, bool training, const Tensor& y,
                                 const Tensor& h_n, const Tensor& c_n) {
  KernelScope scope("lstm_layer", {&y, &h_n, &c_n, &x, &h0, &c0, &weight_ih, &weight_hh, &bias});
  return rnn_forward(*this, Cell::lstm, scope.stream(), {x, h0, c0, y, h_n, c_n},
                     {weight_ih, weight_hh, bias, Tensor()}, training);
}

// Backpropagation through time of the LSTM above; grad_bias is the gradient
// of b_W (that of bias_ih and bias_hh alike).
void CudaBackend::lstm_backward(const Tensor& grad_y, const Tensor& grad_h_n,
                                const Tensor& grad_c_n, const Tensor& x, const Tensor& h0,
                                const Tensor& c0, const Tensor& weight_ih, const Tensor& weight_hh,
                                const Tensor& bias, const Tensor& y, const Tensor& record,
                                const Tensor& grad_x, const Tensor& grad_h0, const Tensor& grad_c0,
                                const Tensor& grad_weight_ih, const Tensor& grad_weight_hh,
                                const Tensor& grad_bias) {
  KernelScope scope(
      "lstm_layer backward",
      {&grad_x, &grad_h0, &grad_c0, &grad_weight_ih, &grad_weight_hh, &grad_bias, &grad_y,
       &grad_h_n, &grad_c_n, &x, &h0, &c0, &weight_ih, &weight_hh, &bias, &y, &record});
  rnn_backward(*this, Cell::lstm, scope.stream(), {x, h0, c0, y, Tensor(), Tensor()}, record,
               {grad_y, grad_h_n, grad_c_n, grad_x, grad_h0, grad_c0},
               {grad_weight_ih, grad_weight_hh, grad_bias, Tensor()});
}

// r = sigmoid(gi_r + gh_r), z = sigmoid(gi_z + gh_z), n = tanh(gi_n + r gh_n),
// h_t = (1 - z) n + z h_{t-1}: cuDNN's GRU with b_W = bias_ih, b_R = bias_hh.
Tensor CudaBackend::gru_forward(const Tensor& x, const Tensor& h0, const Tensor& weight_ih,
                                const Tensor& weight_hh, const Tensor& bias_ih,
                                const Tensor& bias_hh, bool training, const Tensor& y,
                                const Tensor& h_n) {
  KernelScope scope("gru_layer", {&y, &h_n, &x, &h0, &weight_ih, &weight_hh, &bias_ih, &bias_hh});
  return rnn_forward(*this, Cell::gru, scope.stream(), {x, h0, Tensor(), y, h_n, Tensor()},
                     {weight_ih, weight_hh, bias_ih, bias_hh}, training);
}

// Backpropagation through time of the GRU above.
void CudaBackend::gru_backward(const Tensor& grad_y, const Tensor& grad_h_n, const Tensor& x,
                               const Tensor& h0, const Tensor& weight_ih, const Tensor& weight_hh,
                               const Tensor& bias_ih, const Tensor& bias_hh, const Tensor& y,
                               const Tensor& record, const Tensor& grad_x, const Tensor& grad_h0,
                               const Tensor& grad_weight_ih, const Tensor& grad_weight_hh,
                               const Tensor& grad_bias_ih, const Tensor& grad_bias_hh) {
  KernelScope scope(
      "gru_layer backward",
      {&grad_x, &grad_h0, &grad_weight_ih, &grad_weight_hh, &grad_bias_ih, &grad_bias_hh, &grad_y,
       &grad_h_n, &x, &h0, &weight_ih, &weight_hh, &bias_ih, &bias_hh, &y, &record});
  rnn_backward(*this, Cell::gru, scope.stream(), {x, h0, Tensor(), y, Tensor(), Tensor()}, record,
               {grad_y, grad_h_n, Tensor(), grad_x, grad_h0, Tensor()},
               {grad_weight_ih, grad_weight_hh, grad_bias_ih, grad_bias_hh});
}

}  // namespace trainer::cuda
