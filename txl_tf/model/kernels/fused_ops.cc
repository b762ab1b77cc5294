// Fused CPU kernels for training steps (txl_tf/fused.py builds and loads this file; see docs/performance.md).
//
// TensorFlow runs elementwise work as separate ops, each a full pass over its tensor through memory. On a CPU whose
// matmuls are fast (bfloat16 on AMX) these passes take much of a training step. Five chains get one kernel each way:
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
// 3. The residual and the post-norm LayerNorm, LayerNorm(x + residual) over the last axis (d): TensorFlow ops
//    run it as add, cast to float32, mean, squared difference, mean, rsqrt, scale and shift, cast back (Keras'
//    layer_normalization), and about as many ops backward. TxlAddLayerNorm does one row of d at a time in float32
//    and keeps each row's mean and 1 / sqrt(variance + epsilon); TxlAddLayerNormGrad recomputes the normalized
//    row from them and gives the gradient of the sum (the same for x and the residual) and those of gamma and
//    beta. gamma's and beta's gradients are sums over rows: each block of kNormBlock rows writes its partial sums,
//    and the blocks are added in order, so they too do not depend on the thread count.
//
// 4. The feed-forward layer's inner activation, dropout(relu(z + bias)) for z = x W (the matmul stays oneDNN's):
//    TensorFlow runs it as a matmul fused with the bias and ReLU, then dropout; backward as dropout's gradient,
//    ReluGrad and BiasAddGrad, three passes over [M, F]. TxlBiasReluDropout draws the same bits as TxlDropout for
//    the same seed (so it equals bias, ReLU and TxlDropout in turn); TxlBiasReluDropoutGrad needs only its output
//    y: an element passes its gradient (times scale) exactly when y > 0, since a dropped element and a negative one
//    are both 0. bias's gradient is summed in blocks of rows added in order, as LayerNorm's gamma and beta.
//
// 5. The attention's heads. The projections come out as [B, T, N*D] rows (q, or k and v side by side) and the
//    score matmuls want head-major [N, B, T, D]; TensorFlow ops run this as split, reshape and transpose (and the
//    output's transpose back), each a pass through memory, and their gradients as transpose and concat.
//    TxlSplitHeads copies each row's C*N pieces of D straight to their places in C head-major outputs;
//    TxlMergeHeads is its inverse, and each is the other's gradient. Pure copies: bit for bit TensorFlow's result.
//
// Rows (and blocks of 8 dropout elements) are independent and each is computed by one thread in a fixed order, so
// results do not depend on the thread count.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <vector>

#include "Eigen/Core"
#include "tensorflow/core/framework/common_shape_fns.h"
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

// The attributes of the ops that drop: `threshold` (of 65536) and `scale`, checked.
void GetDropoutAttrs(OpKernelConstruction* ctx, int* threshold, float* scale) {
  OP_REQUIRES_OK(ctx, ctx->GetAttr("threshold", threshold));
  OP_REQUIRES_OK(ctx, ctx->GetAttr("scale", scale));
  OP_REQUIRES(ctx, *threshold >= 0 && *threshold < 65536,
              errors::InvalidArgument("threshold must be in [0, 65536), got ", *threshold));
}

constexpr int64_t kChunk = 8 * kLanes;  // elements per PhiloxBlocks call: the unit the dropping ops shard

// Calls fn(start, count, bits) for each chunk of kChunk of n elements, sharded over the CPU pool: bits holds the
// chunk's 16-bit Philox words for `seed` (element e of the tensor gets word e), all zero when threshold is 0
// (nothing is dropped, so none are drawn). `cost` is the work per chunk for the sharder.
template <typename Fn>
void ForEachDropChunk(OpKernelContext* ctx, const Tensor& seed, int64_t n, uint32_t threshold, int64_t cost,
                      Fn fn) {
  if (n == 0) return;
  const auto s = seed.flat<int32_t>();
  const uint32_t key0 = static_cast<uint32_t>(s(1)), key1 = static_cast<uint32_t>(s(0));
  auto chunks = [&](int64_t begin, int64_t end) {
    uint16_t bits[kChunk];
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      if (threshold > 0) {
        PhiloxBlocks(static_cast<uint64_t>(chunk) * kLanes, key0, key1, bits);
      } else {
        std::fill(bits, bits + kChunk, 0);
      }
      fn(chunk * kChunk, std::min(kChunk, n - chunk * kChunk), bits);
    }
  };
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads();
  ::tensorflow::Shard(pool->num_threads, pool->workers, (n + kChunk - 1) / kChunk, cost, chunks);
}

void CheckSeed(OpKernelContext* ctx, const Tensor& seed) {
  OP_REQUIRES(ctx, seed.dims() == 1 && seed.dim_size(0) == 2,
              errors::InvalidArgument("seed must be [2], got ", seed.shape().DebugString()));
}

template <typename T>
class DropoutOp : public OpKernel {
 public:
  explicit DropoutOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    GetDropoutAttrs(ctx, &threshold_, &scale_);
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& input = ctx->input(0);
    const Tensor& seed = ctx->input(1);
    CheckSeed(ctx, seed);
    if (!ctx->status().ok()) return;
    Tensor* output = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, input.shape(), &output));
    const int64_t n = input.NumElements();
    const T* x = input.flat<T>().data();
    T* y = output->flat<T>().data();
    const uint32_t threshold = static_cast<uint32_t>(threshold_);
    const float scale = scale_;
    ForEachDropChunk(ctx, seed, n, threshold, 20 * kChunk, [&](int64_t start, int64_t count, const uint16_t* bits) {
      ApplyMask(x + start, bits, threshold, scale, count, y + start);
    });
  }

 private:
  int threshold_ = 0;
  float scale_ = 1.0f;
};

// LayerNorm's rows are [M, d]; gamma and beta [d], float32 (Keras keeps them float32 under mixed precision).
constexpr int64_t kNormBlock = 16;  // rows per partial sum of gamma's, beta's and the feed-forward bias's gradients

// Column sums over `rows` rows that do not depend on the thread count: fn(row_begin, row_end, sums) adds its
// rows' contributions to sums ([outs.size(), width], zeroed) for one block of kNormBlock rows, the blocks run
// sharded over the CPU pool (`cost` per row), and their sums are then added into outs[p] ([width] each) in block
// order.
template <typename Fn>
void SumRowBlocks(OpKernelContext* ctx, int64_t rows, int64_t width, int64_t cost, std::initializer_list<float*> outs,
                  Fn fn) {
  const int64_t parts = static_cast<int64_t>(outs.size());
  for (float* out : outs) std::fill(out, out + width, 0.0f);
  if (rows * width == 0) return;
  const int64_t blocks = (rows + kNormBlock - 1) / kNormBlock;
  Tensor partial;
  OP_REQUIRES_OK(ctx, ctx->allocate_temp(::tensorflow::DT_FLOAT, TensorShape({blocks, parts, width}), &partial));
  float* part = partial.flat<float>().data();
  auto run = [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      float* sums = part + block * parts * width;
      std::fill(sums, sums + parts * width, 0.0f);
      fn(block * kNormBlock, std::min(rows, (block + 1) * kNormBlock), sums);
    }
  };
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads();
  ::tensorflow::Shard(pool->num_threads, pool->workers, blocks, cost * kNormBlock, run);
  for (int64_t block = 0; block < blocks; ++block) {
    int64_t p = 0;
    for (float* out : outs) Row<float>(out, width) += ConstRow<float>(part + (block * parts + p++) * width, width);
  }
}

void CheckNormShapes(OpKernelContext* ctx, const Tensor& x, const Tensor& residual, const Tensor& gamma,
                     int64_t* m, int64_t* d) {
  OP_REQUIRES(ctx, x.dims() == 2, errors::InvalidArgument("x must be [M, d], got ", x.shape().DebugString()));
  *m = x.dim_size(0);
  *d = x.dim_size(1);
  OP_REQUIRES(ctx, residual.shape() == x.shape(),
              errors::InvalidArgument("residual must have x's shape ", x.shape().DebugString(), ", got ",
                                      residual.shape().DebugString()));
  OP_REQUIRES(ctx, gamma.dims() == 1 && gamma.dim_size(0) == *d,
              errors::InvalidArgument("gamma and beta must be [d] = [", *d, "], got ", gamma.shape().DebugString()));
}

template <typename T>
class AddLayerNormOp : public OpKernel {
 public:
  explicit AddLayerNormOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("epsilon", &epsilon_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& residual = ctx->input(1);
    const Tensor& gamma = ctx->input(2);
    const Tensor& beta = ctx->input(3);
    int64_t M = 0, D = 0;
    CheckNormShapes(ctx, x, residual, gamma, &M, &D);
    if (!ctx->status().ok()) return;
    OP_REQUIRES(ctx, beta.shape() == gamma.shape(),
                errors::InvalidArgument("beta must be [", D, "], got ", beta.shape().DebugString()));
    Tensor* y = nullptr;
    Tensor* mean = nullptr;
    Tensor* rstd = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &y));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({M}), &mean));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({M}), &rstd));
    if (M * D == 0) return;
    const T* a = x.flat<T>().data();
    const T* b = residual.flat<T>().data();
    const ConstRow<float> g(gamma.flat<float>().data(), D), be(beta.flat<float>().data(), D);
    T* out = y->flat<T>().data();
    float* mu = mean->flat<float>().data();
    float* rs = rstd->flat<float>().data();
    const float eps = epsilon_;
    auto rows = [&](int64_t begin, int64_t end) {
      RowF z(D);
      for (int64_t row = begin; row < end; ++row) {
        z = ConstRow<T>(a + row * D, D).template cast<float>() + ConstRow<T>(b + row * D, D).template cast<float>();
        const float m = z.sum() / D;
        z -= m;
        const float r = 1.0f / std::sqrt(z.square().sum() / D + eps);
        Row<T>(out + row * D, D) = (z * r * g + be).template cast<T>();
        mu[row] = m;
        rs[row] = r;
      }
    };
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads();
    ::tensorflow::Shard(pool->num_threads, pool->workers, M, 12 * D, rows);
  }

 private:
  float epsilon_ = 0.0f;
};

template <typename T>
class AddLayerNormGradOp : public OpKernel {
 public:
  explicit AddLayerNormGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& grad = ctx->input(0);
    const Tensor& x = ctx->input(1);
    const Tensor& residual = ctx->input(2);
    const Tensor& gamma = ctx->input(3);
    const Tensor& mean = ctx->input(4);
    const Tensor& rstd = ctx->input(5);
    int64_t M = 0, D = 0;
    CheckNormShapes(ctx, x, residual, gamma, &M, &D);
    if (!ctx->status().ok()) return;
    OP_REQUIRES(ctx, grad.shape() == x.shape(),
                errors::InvalidArgument("grad must have x's shape ", x.shape().DebugString(), ", got ",
                                        grad.shape().DebugString()));
    OP_REQUIRES(ctx, mean.dims() == 1 && mean.dim_size(0) == M && rstd.shape() == mean.shape(),
                errors::InvalidArgument("mean and rstd must be [M] = [", M, "], got ", mean.shape().DebugString(),
                                        " and ", rstd.shape().DebugString()));
    Tensor* d_sum = nullptr;
    Tensor* d_gamma = nullptr;
    Tensor* d_beta = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &d_sum));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, gamma.shape(), &d_gamma));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, gamma.shape(), &d_beta));
    const T* dy = grad.flat<T>().data();
    const T* a = x.flat<T>().data();
    const T* b = residual.flat<T>().data();
    const ConstRow<float> g(gamma.flat<float>().data(), D);
    const float* mu = mean.flat<float>().data();
    const float* rs = rstd.flat<float>().data();
    T* dz = d_sum->flat<T>().data();
    // Sums of grad * normalized row (gamma's gradient) and of grad (beta's).
    SumRowBlocks(ctx, M, D, 16 * D, {d_gamma->flat<float>().data(), d_beta->flat<float>().data()},
                 [&](int64_t begin, int64_t end, float* sums) {
                   Row<float> pg(sums, D), pb(sums + D, D);
                   RowF xhat(D), dyf(D), gy(D);
                   for (int64_t row = begin; row < end; ++row) {
                     xhat = (ConstRow<T>(a + row * D, D).template cast<float>() +
                             ConstRow<T>(b + row * D, D).template cast<float>() - mu[row]) * rs[row];
                     dyf = ConstRow<T>(dy + row * D, D).template cast<float>();
                     pg += dyf * xhat;
                     pb += dyf;
                     gy = dyf * g;
                     const float mean_gy = gy.sum() / D, mean_gy_xhat = (gy * xhat).sum() / D;
                     Row<T>(dz + row * D, D) = ((gy - mean_gy - xhat * mean_gy_xhat) * rs[row]).template cast<T>();
                   }
                 });
  }
};

template <typename T>
class BiasReluDropoutOp : public OpKernel {
 public:
  explicit BiasReluDropoutOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    GetDropoutAttrs(ctx, &threshold_, &scale_);
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& z = ctx->input(0);
    const Tensor& bias = ctx->input(1);
    const Tensor& seed = ctx->input(2);
    OP_REQUIRES(ctx, z.dims() == 2, errors::InvalidArgument("z must be [M, F], got ", z.shape().DebugString()));
    const int64_t F = z.dim_size(1), n = z.NumElements();
    OP_REQUIRES(ctx, bias.dims() == 1 && bias.dim_size(0) == F,
                errors::InvalidArgument("bias must be [F] = [", F, "], got ", bias.shape().DebugString()));
    CheckSeed(ctx, seed);
    if (!ctx->status().ok()) return;
    Tensor* output = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, z.shape(), &output));
    const T* x = z.flat<T>().data();
    const float* b = bias.flat<float>().data();
    T* y = output->flat<T>().data();
    const uint32_t threshold = static_cast<uint32_t>(threshold_);
    const float scale = scale_;
    ForEachDropChunk(ctx, seed, n, threshold, 24 * kChunk, [&](int64_t start, int64_t count, const uint16_t* bits) {
      T v[kChunk];  // relu(z + bias), rounded to T as TensorFlow's ReLU output is; then dropped as TxlDropout
      for (int64_t e = 0; e < count;) {  // the chunk's pieces of rows
        const int64_t col = (start + e) % F, len = std::min(count - e, F - col);
        Row<T>(v + e, len) =
            (ConstRow<T>(x + start + e, len).template cast<float>() + ConstRow<float>(b + col, len))
                .max(0.0f)
                .template cast<T>();
        e += len;
      }
      ApplyMask(v, bits, threshold, scale, count, y + start);
    });
  }

 private:
  int threshold_ = 0;
  float scale_ = 1.0f;
};

template <typename T>
class BiasReluDropoutGradOp : public OpKernel {
 public:
  explicit BiasReluDropoutGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("scale", &scale_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& grad = ctx->input(0);
    const Tensor& y = ctx->input(1);
    OP_REQUIRES(ctx, y.dims() == 2, errors::InvalidArgument("y must be [M, F], got ", y.shape().DebugString()));
    OP_REQUIRES(ctx, grad.shape() == y.shape(),
                errors::InvalidArgument("grad must have y's shape ", y.shape().DebugString(), ", got ",
                                        grad.shape().DebugString()));
    const int64_t M = y.dim_size(0), F = y.dim_size(1);
    Tensor* d_z = nullptr;
    Tensor* d_bias = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, y.shape(), &d_z));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({F}), &d_bias));
    const T* g = grad.flat<T>().data();
    const T* out = y.flat<T>().data();
    T* dz = d_z->flat<T>().data();
    const float scale = scale_;
    SumRowBlocks(ctx, M, F, 6 * F, {d_bias->flat<float>().data()}, [&](int64_t begin, int64_t end, float* sums) {
      Row<float> sum(sums, F);
      RowF d(F);
      for (int64_t row = begin; row < end; ++row) {
        d = (ConstRow<T>(out + row * F, F).template cast<float>() > 0.0f)
                .select(ConstRow<T>(g + row * F, F).template cast<float>() * scale, 0.0f);
        Row<T>(dz + row * F, F) = d.template cast<T>();
        sum += d;
      }
    });
  }

 private:
  float scale_ = 1.0f;
};

// The heads' layout: x [B, T, C*N*D] and C tensors [N, B, T, D]. Row r = b*T + t of x holds head n of part c at
// (c*N + n)*D; in part c that piece is at (n*B*T + r)*D.
void GetHeadsAttrs(OpKernelConstruction* ctx, int* num_heads, int* num_splits) {
  OP_REQUIRES_OK(ctx, ctx->GetAttr("num_heads", num_heads));
  OP_REQUIRES_OK(ctx, ctx->GetAttr("num_splits", num_splits));
}

// Calls copy(c, x_offset, head_offset) for each piece of D elements, a row of x at a time, the rows sharded over
// the CPU pool.
template <typename Fn>
void ForEachHeadPiece(OpKernelContext* ctx, int64_t rows, int64_t num_splits, int64_t num_heads, int64_t d,
                      Fn copy) {
  if (rows * d == 0) return;
  auto work = [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      int64_t x_offset = row * num_splits * num_heads * d;
      for (int64_t c = 0; c < num_splits; ++c) {
        for (int64_t n = 0; n < num_heads; ++n, x_offset += d) copy(c, x_offset, (n * rows + row) * d);
      }
    }
  };
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads();
  ::tensorflow::Shard(pool->num_threads, pool->workers, rows, 2 * num_splits * num_heads * d, work);
}

template <typename T>
class SplitHeadsOp : public OpKernel {
 public:
  explicit SplitHeadsOp(OpKernelConstruction* ctx) : OpKernel(ctx) { GetHeadsAttrs(ctx, &num_heads_, &num_splits_); }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const int64_t parts = static_cast<int64_t>(num_heads_) * num_splits_;
    OP_REQUIRES(ctx, x.dims() == 3 && x.dim_size(2) % parts == 0,
                errors::InvalidArgument("x must be [B, T, num_splits * num_heads * D] with num_splits * num_heads = ",
                                        parts, ", got ", x.shape().DebugString()));
    const int64_t D = x.dim_size(2) / parts;
    std::vector<T*> heads;
    for (int c = 0; c < num_splits_; ++c) {
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(c, TensorShape({num_heads_, x.dim_size(0), x.dim_size(1), D}), &out));
      heads.push_back(out->flat<T>().data());
    }
    const T* src = x.flat<T>().data();
    ForEachHeadPiece(ctx, x.dim_size(0) * x.dim_size(1), num_splits_, num_heads_, D,
                     [&](int64_t c, int64_t x_offset, int64_t head_offset) {
                       std::memcpy(heads[c] + head_offset, src + x_offset, D * sizeof(T));
                     });
  }

 private:
  int num_heads_ = 1, num_splits_ = 1;
};

template <typename T>
class MergeHeadsOp : public OpKernel {
 public:
  explicit MergeHeadsOp(OpKernelConstruction* ctx) : OpKernel(ctx) { GetHeadsAttrs(ctx, &num_heads_, &num_splits_); }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& first = ctx->input(0);
    OP_REQUIRES(ctx, first.dims() == 4 && first.dim_size(0) == num_heads_,
                errors::InvalidArgument("heads must be [num_heads = ", num_heads_, ", B, T, D], got ",
                                        first.shape().DebugString()));
    std::vector<const T*> heads;
    for (int c = 0; c < num_splits_; ++c) {
      const Tensor& part = ctx->input(c);
      OP_REQUIRES(ctx, part.shape() == first.shape(),
                  errors::InvalidArgument("heads[", c, "] must have heads[0]'s shape ", first.shape().DebugString(),
                                          ", got ", part.shape().DebugString()));
      heads.push_back(part.flat<T>().data());
    }
    const int64_t B = first.dim_size(1), L = first.dim_size(2), D = first.dim_size(3);
    Tensor* output = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({B, L, num_splits_ * num_heads_ * D}), &output));
    T* dst = output->flat<T>().data();
    ForEachHeadPiece(ctx, B * L, num_splits_, num_heads_, D, [&](int64_t c, int64_t x_offset, int64_t head_offset) {
      std::memcpy(dst + x_offset, heads[c] + head_offset, D * sizeof(T));
    });
  }

 private:
  int num_heads_ = 1, num_splits_ = 1;
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
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc("Inverted dropout: zero where 16 Philox bits keyed by seed are below threshold (of 65536), else x * scale.");

REGISTER_OP("TxlAddLayerNorm")
    .Input("x: T")
    .Input("residual: T")
    .Input("gamma: float")
    .Input("beta: float")
    .Output("y: T")
    .Output("mean: float")
    .Output("rstd: float")
    .Attr("T: {float, bfloat16}")
    .Attr("epsilon: float")
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      ::tensorflow::shape_inference::ShapeHandle x, rows;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &x));
      c->set_output(0, x);
      TF_RETURN_IF_ERROR(c->Subshape(x, 0, 1, &rows));
      c->set_output(1, rows);
      c->set_output(2, rows);
      return ::tensorflow::OkStatus();
    })
    .Doc("LayerNorm(x + residual) over the last axis, with each row's mean and 1 / sqrt(variance + epsilon).");

REGISTER_OP("TxlAddLayerNormGrad")
    .Input("grad: T")
    .Input("x: T")
    .Input("residual: T")
    .Input("gamma: float")
    .Input("mean: float")
    .Input("rstd: float")
    .Output("d_sum: T")
    .Output("d_gamma: float")
    .Output("d_beta: float")
    .Attr("T: {float, bfloat16}")
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(1));
      c->set_output(1, c->input(3));
      c->set_output(2, c->input(3));
      return ::tensorflow::OkStatus();
    })
    .Doc("Gradient of TxlAddLayerNorm: of x + residual (the same for both), of gamma and of beta.");

REGISTER_OP("TxlBiasReluDropout")
    .Input("z: T")
    .Input("bias: float")
    .Input("seed: int32")
    .Output("y: T")
    .Attr("T: {float, bfloat16}")
    .Attr("threshold: int")
    .Attr("scale: float")
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc("Dropout (TxlDropout's bits for seed) of relu(z + bias) over [M, F].");

REGISTER_OP("TxlBiasReluDropoutGrad")
    .Input("grad: T")
    .Input("y: T")
    .Output("d_z: T")
    .Output("d_bias: float")
    .Attr("T: {float, bfloat16}")
    .Attr("scale: float")
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(1));
      c->set_output(1, c->Vector(c->Dim(c->input(1), 1)));
      return ::tensorflow::OkStatus();
    })
    .Doc("Gradient of TxlBiasReluDropout from its output y: grad * scale where y > 0, else 0; and its column sums.");

REGISTER_OP("TxlSplitHeads")
    .Input("x: T")
    .Output("heads: num_splits * T")
    .Attr("T: {float, bfloat16}")
    .Attr("num_heads: int >= 1")
    .Attr("num_splits: int >= 1")
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      ::tensorflow::shape_inference::ShapeHandle x;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &x));
      int num_heads = 1, num_splits = 1;
      TF_RETURN_IF_ERROR(c->GetAttr("num_heads", &num_heads));
      TF_RETURN_IF_ERROR(c->GetAttr("num_splits", &num_splits));
      ::tensorflow::shape_inference::DimensionHandle d;
      TF_RETURN_IF_ERROR(c->Divide(c->Dim(x, 2), static_cast<int64_t>(num_heads) * num_splits, true, &d));
      for (int i = 0; i < num_splits; ++i) {
        c->set_output(i, c->MakeShape({c->MakeDim(num_heads), c->Dim(x, 0), c->Dim(x, 1), d}));
      }
      return ::tensorflow::OkStatus();
    })
    .Doc("[B, T, num_splits*num_heads*D] -> num_splits tensors [num_heads, B, T, D] (split, then heads first).");

REGISTER_OP("TxlMergeHeads")
    .Input("heads: num_splits * T")
    .Output("x: T")
    .Attr("T: {float, bfloat16}")
    .Attr("num_heads: int >= 1")
    .Attr("num_splits: int >= 1")
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      ::tensorflow::shape_inference::ShapeHandle head;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 4, &head));
      int num_heads = 1, num_splits = 1;
      TF_RETURN_IF_ERROR(c->GetAttr("num_heads", &num_heads));
      TF_RETURN_IF_ERROR(c->GetAttr("num_splits", &num_splits));
      ::tensorflow::shape_inference::DimensionHandle width;
      TF_RETURN_IF_ERROR(c->Multiply(c->Dim(head, 3), static_cast<int64_t>(num_heads) * num_splits, &width));
      c->set_output(0, c->MakeShape({c->Dim(head, 1), c->Dim(head, 2), width}));
      return ::tensorflow::OkStatus();
    })
    .Doc("The inverse of TxlSplitHeads: num_splits tensors [num_heads, B, T, D] -> [B, T, num_splits*num_heads*D].");

#define TXL_TF_REGISTER(T)                                                                           \
  REGISTER_KERNEL_BUILDER(Name("TxlRelSoftmax").Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("T"), \
                          txl_tf::RelSoftmaxOp<T>);                                                  \
  REGISTER_KERNEL_BUILDER(                                                                           \
      Name("TxlRelSoftmaxGrad").Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),             \
      txl_tf::RelSoftmaxGradOp<T>);                                                          \
  REGISTER_KERNEL_BUILDER(Name("TxlDropout").Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),    \
                          txl_tf::DropoutOp<T>);                                                     \
  REGISTER_KERNEL_BUILDER(                                                                           \
      Name("TxlAddLayerNorm").Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),               \
      txl_tf::AddLayerNormOp<T>);                                                                    \
  REGISTER_KERNEL_BUILDER(                                                                           \
      Name("TxlAddLayerNormGrad").Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),           \
      txl_tf::AddLayerNormGradOp<T>);                                                                \
  REGISTER_KERNEL_BUILDER(                                                                           \
      Name("TxlBiasReluDropout").Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),            \
      txl_tf::BiasReluDropoutOp<T>);                                                                 \
  REGISTER_KERNEL_BUILDER(                                                                           \
      Name("TxlBiasReluDropoutGrad").Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),        \
      txl_tf::BiasReluDropoutGradOp<T>);                                                             \
  REGISTER_KERNEL_BUILDER(Name("TxlSplitHeads").Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("T"), \
                          txl_tf::SplitHeadsOp<T>);                                                  \
  REGISTER_KERNEL_BUILDER(Name("TxlMergeHeads").Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("T"), \
                          txl_tf::MergeHeadsOp<T>);
TXL_TF_REGISTER(float)
TXL_TF_REGISTER(Eigen::bfloat16)
