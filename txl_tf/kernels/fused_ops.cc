// Fused CPU kernels for training steps (txl_tf/fused.py builds and loads this file; see docs/performance.md).
//
// TensorFlow runs elementwise work as separate ops, each a full pass over its tensor through memory. On a CPU whose
// matmuls are fast (bfloat16 on AMX) these passes take much of a training step. Two chains get one kernel each way:
//
// 1. The attention's score chain. TensorFlow ops run it over the [G, L, K] scores (G = heads x batch) as slice
//    (the relative shift), add, cast to float32, add the mask, softmax, cast back; and in the backward pass cast,
//    multiply, row sum, subtract, multiply, cast, pad. Here, a row of K scores at a time in float32:
//
//    TxlRelSoftmax:     probs[g, i, :] = softmax(content[g, i, :] + shift(position)[g, i, :] + bias[i, :])
//                       lse[g, i]      = log sum_j exp(...)               (kept for the backward pass)
//    TxlRelSoftmaxGrad: p = exp(content + shift(position) + bias - lse)   (the float32 probabilities, recomputed)
//                       d = p * (grad - sum_j p_j grad_j)                 -> d_content, and d_position shifted back
//
//    shift() is Appendix B's relative shift of the position scores, which the caller computes with a zero column
//    in front ([G, L, K+1]): shift(position)[g, i, j] is element L + i * K + j of position[g] read as a flat
//    L * (K+1) buffer. So the shift costs no copy, and its gradient is the same flat write with the first L
//    elements zero. The sum content + shift(position) is formed in float32 (TensorFlow's chain forms it in the
//    input type), and the backward pass uses float32 probabilities, as TensorFlow's SoftmaxGrad does.
//
// 2. Dropout. TensorFlow ops draw random bits, compare, select and scale (four passes, and the mask kept for the
//    backward pass). TxlDropout draws 16 Philox bits per element and applies them in the same pass; an element is
//    dropped when its bits fall below `threshold` (of 65536) and kept ones are multiplied by `scale`. Its gradient
//    is TxlDropout of the incoming gradient with the same seed: the mask is drawn again instead of stored.
//
// Rows (and blocks of 8 dropout elements) are independent and each is computed by one thread in a fixed order, so
// results do not depend on the thread count.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "Eigen/Core"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"

namespace txl_tf {
namespace {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
namespace errors = ::tensorflow::errors;

using RowF = Eigen::Array<float, Eigen::Dynamic, 1>;
template <typename T>
using ConstRow = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>;
template <typename T>
using Row = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;

// Checks content [G, L, K], position [G, L, K+1], bias [L, K]; sets G, L, K.
void CheckShapes(OpKernelContext* ctx, const Tensor& content, const Tensor& position, const Tensor& bias,
                 int64_t* g, int64_t* l, int64_t* k) {
  OP_REQUIRES(ctx, content.dims() == 3,
              errors::InvalidArgument("content must be [G, L, K], got ", content.shape().DebugString()));
  *g = content.dim_size(0);
  *l = content.dim_size(1);
  *k = content.dim_size(2);
  OP_REQUIRES(ctx,
              position.dims() == 3 && position.dim_size(0) == *g && position.dim_size(1) == *l &&
                  position.dim_size(2) == *k + 1,
              errors::InvalidArgument("position must be [G, L, K+1] = [", *g, ", ", *l, ", ", *k + 1, "], got ",
                                      position.shape().DebugString()));
  OP_REQUIRES(ctx, bias.dims() == 2 && bias.dim_size(0) == *l && bias.dim_size(1) == *k,
              errors::InvalidArgument("bias must be [L, K] = [", *l, ", ", *k, "], got ",
                                      bias.shape().DebugString()));
}

template <typename T>
class RelSoftmaxOp : public OpKernel {
 public:
  explicit RelSoftmaxOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& content = ctx->input(0);
    const Tensor& position = ctx->input(1);
    const Tensor& bias = ctx->input(2);
    int64_t G = 0, L = 0, K = 0;
    CheckShapes(ctx, content, position, bias, &G, &L, &K);
    if (!ctx->status().ok()) return;
    Tensor* probs = nullptr;
    Tensor* lse = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, content.shape(), &probs));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({G, L}), &lse));
    if (G * L * K == 0) return;
    const T* c = content.flat<T>().data();
    const T* p = position.flat<T>().data();
    const float* b = bias.flat<float>().data();
    T* out = probs->flat<T>().data();
    float* lse_out = lse->flat<float>().data();
    auto rows = [&](int64_t begin, int64_t end) {
      RowF s(K);
      for (int64_t row = begin; row < end; ++row) {
        const int64_t g = row / L, i = row % L;
        s = ConstRow<T>(c + row * K, K).template cast<float>() +
            ConstRow<T>(p + g * L * (K + 1) + L + i * K, K).template cast<float>() + ConstRow<float>(b + i * K, K);
        const float m = s.maxCoeff();
        s = (s - m).exp();
        const float sum = s.sum();
        Row<T>(out + row * K, K) = (s * (1.0f / sum)).template cast<T>();
        lse_out[row] = m + std::log(sum);
      }
    };
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads();
    ::tensorflow::Shard(pool->num_threads, pool->workers, G * L, 30 * K, rows);
  }
};

template <typename T>
class RelSoftmaxGradOp : public OpKernel {
 public:
  explicit RelSoftmaxGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& grad = ctx->input(0);
    const Tensor& content = ctx->input(1);
    const Tensor& position = ctx->input(2);
    const Tensor& bias = ctx->input(3);
    const Tensor& lse = ctx->input(4);
    int64_t G = 0, L = 0, K = 0;
    CheckShapes(ctx, content, position, bias, &G, &L, &K);
    if (!ctx->status().ok()) return;
    OP_REQUIRES(ctx, grad.shape() == content.shape(),
                errors::InvalidArgument("grad must have content's shape ", content.shape().DebugString(),
                                        ", got ", grad.shape().DebugString()));
    OP_REQUIRES(ctx, lse.dims() == 2 && lse.dim_size(0) == G && lse.dim_size(1) == L,
                errors::InvalidArgument("lse must be [G, L], got ", lse.shape().DebugString()));
    Tensor* d_content = nullptr;
    Tensor* d_position = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, content.shape(), &d_content));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, position.shape(), &d_position));
    if (G * L * K == 0) {
      d_position->flat<T>().setZero();
      return;
    }
    const T* gr = grad.flat<T>().data();
    const T* c = content.flat<T>().data();
    const T* p = position.flat<T>().data();
    const float* b = bias.flat<float>().data();
    const float* ls = lse.flat<float>().data();
    T* dc = d_content->flat<T>().data();
    T* dp = d_position->flat<T>().data();
    auto rows = [&](int64_t begin, int64_t end) {
      RowF prob(K), g_row(K);
      for (int64_t row = begin; row < end; ++row) {
        const int64_t g = row / L, i = row % L;
        const int64_t shifted = g * L * (K + 1) + L + i * K;
        prob = (ConstRow<T>(c + row * K, K).template cast<float>() +
                ConstRow<T>(p + shifted, K).template cast<float>() + ConstRow<float>(b + i * K, K) - ls[row])
                   .exp();
        g_row = ConstRow<T>(gr + row * K, K).template cast<float>();
        const float dot = (prob * g_row).sum();
        prob = prob * (g_row - dot);
        Row<T>(dc + row * K, K) = prob.template cast<T>();
        Row<T>(dp + shifted, K) = prob.template cast<T>();
        // The first L elements of each flat L * (K+1) block are skipped by the shift: their gradient is zero.
        if (i == 0) Row<T>(dp + g * L * (K + 1), L).setZero();
      }
    };
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads();
    ::tensorflow::Shard(pool->num_threads, pool->workers, G * L, 40 * K, rows);
  }
};

// Philox4x32-10 (Salmon et al., 2011; the generator behind TensorFlow's random ops) for a run of consecutive
// counters at once, written lane by lane so the compiler vectorizes the 32x32->64-bit products. Block b's counter
// is (b mod 2^32, b / 2^32, kStream, 0), its key (seed[1], seed[0]); its four output words give elements 8b..8b+7
// two 16-bit halves each, low half first. So the words are those of TensorFlow's own
// StatelessRandomUniformFullIntV2(alg=Philox, key=[seed[1] + 2^32 seed[0]], counter=[0, kStream]) (a test checks).
constexpr int kLanes = 64;
constexpr uint32_t kStream = 0x74786c5fu;  // "txl_": a stream of its own, apart from TensorFlow's seeds' streams

inline void PhiloxBlocks(uint64_t first, uint32_t key0, uint32_t key1, uint16_t* bits) {
  uint32_t c0[kLanes], c1[kLanes], c2[kLanes], c3[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    const uint64_t counter = first + l;
    c0[l] = static_cast<uint32_t>(counter);
    c1[l] = static_cast<uint32_t>(counter >> 32);
    c2[l] = kStream;
    c3[l] = 0;
  }
  uint32_t k0 = key0, k1 = key1;
  for (int round = 0; round < 10; ++round) {
    for (int l = 0; l < kLanes; ++l) {
      const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0[l];
      const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c2[l];
      const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1[l] ^ k0;
      const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3[l] ^ k1;
      c1[l] = static_cast<uint32_t>(p1);
      c3[l] = static_cast<uint32_t>(p0);
      c0[l] = n0;
      c2[l] = n2;
    }
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  for (int l = 0; l < kLanes; ++l) {
    const uint32_t words[4] = {c0[l], c1[l], c2[l], c3[l]};
    for (int w = 0; w < 4; ++w) {
      bits[8 * l + 2 * w] = static_cast<uint16_t>(words[w]);
      bits[8 * l + 2 * w + 1] = static_cast<uint16_t>(words[w] >> 16);
    }
  }
}

// y = bits >= threshold ? x * scale : 0, elementwise over n elements.
inline void ApplyMask(const float* x, const uint16_t* bits, uint32_t threshold, float scale, int64_t n, float* y) {
  for (int64_t e = 0; e < n; ++e) y[e] = bits[e] >= threshold ? x[e] * scale : 0.0f;
}

inline void ApplyMask(const Eigen::bfloat16* x, const uint16_t* bits, uint32_t threshold, float scale, int64_t n,
                      Eigen::bfloat16* y) {
  const uint16_t* in = reinterpret_cast<const uint16_t*>(x);
  uint16_t* out = reinterpret_cast<uint16_t*>(y);
  for (int64_t e = 0; e < n; ++e) {
    uint32_t u = static_cast<uint32_t>(in[e]) << 16;
    float v;
    std::memcpy(&v, &u, 4);
    v = bits[e] >= threshold ? v * scale : 0.0f;
    std::memcpy(&u, &v, 4);
    // Round to nearest even, as Eigen's float -> bfloat16 conversion (NaN stays NaN: its mantissa is kept nonzero).
    const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
    u = nan ? (u | 0x00400000u) : u + 0x7fffu + ((u >> 16) & 1u);
    out[e] = static_cast<uint16_t>(u >> 16);
  }
}

template <typename T>
class DropoutOp : public OpKernel {
 public:
  explicit DropoutOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("threshold", &threshold_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("scale", &scale_));
    OP_REQUIRES(ctx, threshold_ >= 0 && threshold_ < 65536,
                errors::InvalidArgument("threshold must be in [0, 65536), got ", threshold_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& input = ctx->input(0);
    const Tensor& seed = ctx->input(1);
    OP_REQUIRES(ctx, seed.dims() == 1 && seed.dim_size(0) == 2,
                errors::InvalidArgument("seed must be [2], got ", seed.shape().DebugString()));
    Tensor* output = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, input.shape(), &output));
    const int64_t n = input.NumElements();
    if (n == 0) return;
    const auto s = seed.flat<int32_t>();
    const uint32_t key0 = static_cast<uint32_t>(s(1)), key1 = static_cast<uint32_t>(s(0));
    const T* x = input.flat<T>().data();
    T* y = output->flat<T>().data();
    const uint32_t threshold = static_cast<uint32_t>(threshold_);
    const float scale = scale_;
    constexpr int64_t kChunk = 8 * kLanes;  // elements per PhiloxBlocks call
    auto chunks = [&](int64_t begin, int64_t end) {
      uint16_t bits[kChunk];
      for (int64_t chunk = begin; chunk < end; ++chunk) {
        const int64_t start = chunk * kChunk;
        PhiloxBlocks(static_cast<uint64_t>(chunk) * kLanes, key0, key1, bits);
        ApplyMask(x + start, bits, threshold, scale, std::min(kChunk, n - start), y + start);
      }
    };
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads();
    ::tensorflow::Shard(pool->num_threads, pool->workers, (n + kChunk - 1) / kChunk, 20 * kChunk, chunks);
  }

 private:
  int threshold_ = 0;
  float scale_ = 1.0f;
};

}  // namespace
}  // namespace txl_tf

REGISTER_OP("TxlRelSoftmax")
    .Input("content: T")
    .Input("position: T")
    .Input("bias: float")
    .Output("probs: T")
    .Output("lse: float")
    .Attr("T: {float, bfloat16}")
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      ::tensorflow::shape_inference::ShapeHandle content, rows;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &content));
      c->set_output(0, content);
      TF_RETURN_IF_ERROR(c->Subshape(content, 0, 2, &rows));
      c->set_output(1, rows);
      return ::tensorflow::OkStatus();
    })
    .Doc("Softmax over K of content + relative-shifted position + bias, and its row log-sum-exp.");

REGISTER_OP("TxlRelSoftmaxGrad")
    .Input("grad: T")
    .Input("content: T")
    .Input("position: T")
    .Input("bias: float")
    .Input("lse: float")
    .Output("d_content: T")
    .Output("d_position: T")
    .Attr("T: {float, bfloat16}")
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(1));
      c->set_output(1, c->input(2));
      return ::tensorflow::OkStatus();
    })
    .Doc("Gradient of TxlRelSoftmax with respect to content and position.");

REGISTER_OP("TxlDropout")
    .Input("x: T")
    .Input("seed: int32")
    .Output("y: T")
    .Attr("T: {float, bfloat16}")
    .Attr("threshold: int")
    .Attr("scale: float")
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(0));
      return ::tensorflow::OkStatus();
    })
    .Doc("Inverted dropout: zero where 16 Philox bits keyed by seed are below threshold (of 65536), else x * scale.");

#define TXL_TF_REGISTER(T)                                                                           \
  REGISTER_KERNEL_BUILDER(Name("TxlRelSoftmax").Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("T"), \
                          txl_tf::RelSoftmaxOp<T>);                                                  \
  REGISTER_KERNEL_BUILDER(                                                                           \
      Name("TxlRelSoftmaxGrad").Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),             \
      txl_tf::RelSoftmaxGradOp<T>);                                                          \
  REGISTER_KERNEL_BUILDER(Name("TxlDropout").Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),    \
                          txl_tf::DropoutOp<T>);
TXL_TF_REGISTER(float)
TXL_TF_REGISTER(Eigen::bfloat16)
