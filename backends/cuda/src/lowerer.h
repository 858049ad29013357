// The lowering's working state, shared by the files that lower one family of ops each
// (lowering.cpp: the driver and most ops). Internal to backends/cuda.
#pragma once

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "codegen.h"
#include "kiln/cuda/lowering.h"
#include "kiln/ir/graph.h"
#include "kiln/ir/op.h"

namespace kiln::cuda::detail {

constexpr int64_t kAlign = 256;
constexpr int kBlock = 256;
constexpr int64_t kMaxGrid = int64_t{1} << 20;
/// Concats of at most this many elements are one kernel rather than a copy per input.
constexpr int64_t kSmallConcat = 4096;
constexpr int64_t kWorkspaceBytes = int64_t{32} << 20;
constexpr int64_t kFoldLimitBytes = int64_t{64} << 20;
/// Largest im2col buffer a conv may take; larger ones use the direct kernel.
constexpr int64_t kColLimitBytes = int64_t{2} << 30;
/// Most groups a conv lowers as GEMMs (one step each); depthwise-like convs use the direct kernel.
constexpr int64_t kMaxGemmGroups = 8;

inline int64_t align_up(int64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

/// A conv's or pool's window over `nsp` spatial dims: strides, pads (all begins, then all ends)
/// and dilations, with ONNX's defaults (1, 0, 1) where the node leaves them out. Without
/// `has_dilations` (average pooling) the dilations are 1.
struct Window {
  Sizes strides, pads, dilations;
};
inline Window window_of(const Node& n, size_t nsp, bool has_dilations = true) {
  Window w{n.get_ints("strides"), n.get_ints("pads"), has_dilations ? n.get_ints("dilations") : Sizes()};
  if (w.strides.empty()) w.strides.assign(nsp, 1);
  if (w.pads.empty()) w.pads.assign(2 * nsp, 0);
  if (w.dilations.empty()) w.dilations.assign(nsp, 1);
  return w;
}

inline std::string dname(DType t) { return std::string(dtype_name(t)); }

inline std::string value_label(const Value* v) { return "%" + (v->name().empty() ? std::string("<unnamed>") : v->name()); }

inline Status unsupported(const Node& n, const std::string& why) {
  return error_at(n.loc(), StatusCode::kUnimplemented, "cuda: " + n.op_name() + ": " + why);
}

inline Status unsupported_dtype(const Node& n, DType t) {
  return unsupported(n, "dtype " + dname(t) + " is not supported");
}

inline Sizes sizes_of(const Value* v) { return static_sizes(v->shape()); }

/// ONNX slice clamping of one axis: first index, step and count.
struct SliceAxis {
  int64_t start = 0, step = 1, count = 0;
};
inline SliceAxis clamp_slice(int64_t dim, int64_t start, int64_t end, int64_t step) {
  if (start < 0) start += dim;
  if (end < 0) end += dim;
  SliceAxis s;
  s.step = step;
  if (dim == 0) return s;
  int64_t distance;
  if (step > 0) {
    s.start = std::clamp<int64_t>(start, 0, dim);
    distance = std::clamp<int64_t>(end, 0, dim) - s.start;
  } else {
    s.start = std::clamp<int64_t>(start, 0, dim - 1);
    distance = s.start - std::clamp<int64_t>(end, -1, dim - 1);
  }
  const uint64_t abs_step = step > 0 ? static_cast<uint64_t>(step) : 0 - static_cast<uint64_t>(step);
  if (distance > 0) s.count = 1 + static_cast<int64_t>(static_cast<uint64_t>(distance - 1) / abs_step);
  return s;
}

inline int64_t norm_axis(int64_t a, int64_t rank) { return a < 0 ? a + rank : a; }

/// A tensor seen around one axis as `rows` independent rows of `len` elements `inner` apart:
/// the layout the row kernels (argmax/argmin, softmax) walk.
struct AxisRows {
  int64_t len = 0, inner = 1, rows = 0;
};
inline AxisRows rows_around_axis(const Sizes& xs, int64_t axis_attr) {
  const size_t axis = static_cast<size_t>(norm_axis(axis_attr, static_cast<int64_t>(xs.size())));
  AxisRows r;
  r.len = xs[axis];
  r.inner = product(Sizes(xs.begin() + static_cast<std::ptrdiff_t>(axis) + 1, xs.end()));
  r.rows = r.len == 0 ? 0 : product(xs) / r.len;
  return r;
}

/// The operand forms of the wgmma wrappers (wgmma.cpp): A and B from shared memory (K-major,
/// zeroing flag); A from registers with B MN-major (accumulates always).
enum class WgmmaForm { kSharedShared, kRegsMnMajorB };

/// A depthwise conv's sizes, whatever its layout: a 1-D conv is a 2-D one of height 1.
struct DepthwiseGeometry {
  int64_t batch = 1, c = 1, cin = 1, h = 1, w = 1, p = 1, q = 1, r = 1, s = 1;
  int64_t sh = 1, sw = 1, dh = 1, dw = 1, pt = 0, pl = 0;
  bool two_d = true, nhwc = false;
};
/// How a depthwise kernel's blocks tile its output: CB channels x TP rows x TQ columns of one
/// image per block, staged in shared memory with their halo (IH x IW inputs, row pitch IWP);
/// each thread computes U rows x V columns of outputs at a time.
struct DepthwiseTiles {
  int64_t v = 1, u = 1, gq = 1, tq = 1, qt = 1, tp = 1, ptiles = 1, cb = 1, ih = 1, iw = 1, iwp = 1;
  int64_t smem = 0;
};

/// The row geometry of a cross_entropy or cross_entropy_grad (logits [rows, len], classes last).
struct RowLoss {
  DType x_type = DType::kF32, acc_type = DType::kF32;  ///< logits' dtype; f32 math (f64 for f64)
  std::string x_storage, t_storage;
  int64_t rows = 0, len = 0;
  int64_t vec = 1;  ///< elements per load: 16 bytes' worth when the rows allow it
};

class Lowerer {
 public:
  explicit Lowerer(const LoweringOptions& o) : opts_(o) {}
  StatusOr<LoweredGraph> run(const Graph& g);

 private:
  struct Buffer {
    std::string kind;  // input, output, activation, weight, alias (state, rank_weight while lowering)
    DType dtype;
    Sizes shape;
    int64_t bytes = 0;
    int64_t offset = 0;
    int base = -1;
    std::string name;
    /// Per-rank plans: this rank's bytes start rank_stride further per coordinate on mesh axis
    /// rank_axis (collective.cpp).
    std::string rank_axis;
    int64_t rank_stride = 0;
  };
  struct Step {
    std::string text;
    std::vector<int> buffers;
  };

  int add_buffer(std::string kind, DType t, Sizes shape, std::string name = "") {
    Buffer b{std::move(kind), t, std::move(shape), 0, 0, -1, std::move(name), "", 0};
    b.bytes = dtype_storage_bytes(t, product(b.shape));
    bufs_.push_back(std::move(b));
    return static_cast<int>(bufs_.size()) - 1;
  }
  int root(int id) const { return bufs_[id].kind == "alias" ? bufs_[id].base : id; }
  /// A 1-D alias of `elems` elements starting `first` elements into buffer `id`.
  int view(int id, int64_t first, int64_t elems) {
    const int r = root(id);
    const int64_t off = (id == r ? 0 : bufs_[id].offset) + dtype_storage_bytes(bufs_[id].dtype, first);
    const int v = add_buffer("alias", bufs_[id].dtype, {elems});
    bufs_[v].base = r;
    bufs_[v].offset = off;
    return v;
  }
  /// The activation a GEMM epilogue can apply in place of `v`'s only user ("relu", "gelu"),
  /// or "" when there is none. cuBLASLt's GELU is the tanh form, so exact gelu never qualifies.
  std::string sole_activation(const Value* v, bool gelu_ok) const {
    if (v->uses().size() != 1 || v->uses()[0].user == nullptr) return "";
    const Node& u = *v->uses()[0].user;
    if (u.num_operands() != 1 || u.num_results() != 1 || u.result()->dtype() != v->dtype()) return "";
    if (u.op_name() == "relu") return "relu";
    if (gelu_ok && u.op_name() == "gelu" && u.get_string("approximate") == "tanh") return "gelu";
    return "";
  }
  /// Makes the result of `v`'s only user (an activation an epilogue applies) live in `id`.
  void absorb_user(const Value* v, int id) {
    const Node* u = v->uses()[0].user;
    absorbed_.insert(u);
    val_[u->result()] = id;
    if (!u->result()->name().empty()) bufs_[id].name = u->result()->name();
  }
  int buf(const Value* v) const { return val_.at(v); }
  int activation_for(const Value* v) {
    const int id = add_buffer("activation", v->dtype(), sizes_of(v), v->name());
    val_[v] = id;
    return id;
  }
  std::string kernel_name(const std::string& op) { return "k" + std::to_string(kernels_.size()) + "_" + op; }
  void add_kernel(const std::string& name, const std::string& params, const std::string& body) {
    kernels_.push_back(name);
    source_ += "\nextern \"C\" __global__ void __launch_bounds__(" + std::to_string(kBlock) + ") " +
               name + "(" + params + ") {\n" + body + "}\n";
  }
  void launch(const std::string& kernel, int64_t blocks, const std::vector<int>& args) {
    std::string a;
    for (size_t i = 0; i < args.size(); ++i) a += (i ? ",b" : "b") + std::to_string(args[i]);
    steps_.push_back({"step launch kernel=" + kernel + " grid=" +
                          std::to_string(std::clamp<int64_t>(blocks, 1, kMaxGrid)) + ",1,1 block=" +
                          std::to_string(kBlock) + ",1,1 smem=0 args=" + a,
                      args});
  }
  /// A kernel written out whole (its own launch bounds, shared memory, templates): `text`
  /// must define `extern "C" __global__ void NAME(...)`.
  void add_kernel_text(const std::string& name, const std::string& text) {
    kernels_.push_back(name);
    source_ += "\n" + text + "\n";
  }
  /// A launch with an explicit 3-D grid, block size and dynamic shared memory.
  void launch_grid(const std::string& kernel, const Sizes& grid, int64_t block, int64_t smem,
                   const std::vector<int>& args) {
    std::string a;
    for (size_t i = 0; i < args.size(); ++i) a += (i ? ",b" : "b") + std::to_string(args[i]);
    std::string g;
    for (size_t d = 0; d < 3; ++d) g += (d ? "," : "") + std::to_string(d < grid.size() ? grid[d] : 1);
    steps_.push_back({"step launch kernel=" + kernel + " grid=" + g + " block=" + std::to_string(block) +
                          ",1,1 smem=" + std::to_string(smem) + " args=" + a,
                      args});
  }
  /// One thread per element of `n`: the grid-stride loop around `body` (which sees `i`).
  /// `prologue` and `epilogue` (each thread, before and after its loop, e.g. a block-wide
  /// reduction) and a cap on the grid (0: none) serve kernels that also reduce.
  void launch_elementwise(const std::string& kernel, const std::string& params, int64_t n,
                          const std::string& body, const std::vector<int>& args, const std::string& prologue = "",
                          const std::string& epilogue = "", int64_t max_blocks = 0) {
    add_kernel(kernel, params,
               prologue + "  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < " +
                   int_literal(n) + "; i += (long long)gridDim.x * blockDim.x) {\n" + body + "  }\n" + epilogue);
    const int64_t blocks = (n + kBlock - 1) / kBlock;
    launch(kernel, max_blocks > 0 ? std::min(blocks, max_blocks) : blocks, args);
  }
  /// One thread per `width`-element vector of `n` elements (n % width == 0): the grid-stride
  /// loop around `body`, which sees the vector index `q` and its first element `i` (32-bit
  /// when they fit). vectorize.cpp.
  void launch_vectors(const std::string& kernel, const std::string& params, int64_t n, int64_t width,
                      const std::string& body, const std::vector<int>& args, const std::string& prologue = "",
                      const std::string& epilogue = "", int64_t max_blocks = 0);
  /// Whether buffer `id` starts 16-byte aligned (roots do; a view only at a multiple of 16).
  bool aligned16(int id) const { return id == root(id) || bufs_[id].offset % 16 == 0; }
  /// Whether buffer `id` covers its root exactly: the root itself, or a view of all of it.
  bool whole_root(int id) const {
    return id == root(id) || (bufs_[id].offset == 0 && bufs_[id].bytes == bufs_[root(id)].bytes);
  }
  /// The most dynamic shared memory a block may ask for: the target's (Capabilities), else
  /// sm_80's 163 KB, which every target this backend builds for allows.
  int64_t smem_limit() const { return opts_.max_smem_per_block > 0 ? opts_.max_smem_per_block : 166912; }
  /// Whether the plan is the Hopper plugin's (sm_90a and compute_90 images): wgmma, clusters.
  bool hopper_plan() const { return opts_.target.rfind("cuda-sm90", 0) == 0; }
  /// The Hopper warpgroup-MMA helpers in the source (once) and the wrapper of `form` for tile
  /// width n and operand type st (__half or __nv_bfloat16); wgmma.cpp.
  void add_wgmma(WgmmaForm form, int64_t n, const std::string& st);
  /// Elements per 16-byte vector of the widest of `types`, 0 when that is not at least 2.
  static int64_t vector_width(const std::vector<DType>& types);
  /// strided_copy as 16-byte row copies (innermost dim contiguous on both sides) or a 32x32
  /// shared-memory tiled transpose (innermost output dim strided in the input); false when
  /// neither applies (vectorize.cpp).
  StatusOr<bool> vector_copy(const Node& n, int in, int out, Sizes iter, Sizes in_strides, int64_t in_base,
                             Sizes out_strides, int64_t out_base);
  /// Whether `n` is a quantize to f8 that a fused kernel computes as x / scale and stores
  /// rounded (saturating), its f8 value read by nothing in the group.
  bool quantize_epilogue(const Node& n) const;
  /// Whether `n` is an amax over a float value of a fused group, its f32[] read by nothing in
  /// the group: the group's kernel folds max |x| into a per-thread register and combines the
  /// blocks' maxima with an atomic max after its loop (the result zeroed by a memset first).
  bool amax_epilogue(const Node& n) const;
  /// amax code (state.cpp), for the amax kernel and the epilogues: fold |v| into the unsigned
  /// accumulator `acc` (f32 bits), and after the loop combine the block's accumulators into
  /// `*out` with one atomic max.
  static std::string amax_fold(const std::string& acc, const std::string& v);
  static std::string amax_combine(const std::string& acc, const std::string& out);
  StatusOr<std::string> storage(const Node& n, DType t) {
    std::optional<std::string> s = storage_type(t);
    if (!s) return unsupported_dtype(n, t);
    note_dtype(t);
    return *s;
  }
  StatusOr<std::string> reg(const Node& n, DType t) {
    std::optional<std::string> r = reg_type(t);
    if (!r) return unsupported_dtype(n, t);
    note_dtype(t);
    return *r;
  }
  void note_dtype(DType t) {
    fp16_ |= t == DType::kF16;
    bf16_ |= t == DType::kBF16;
  }

  Status check_static(const Value* v) {
    for (size_t d = 0; d < v->shape().size(); ++d)
      if (!v->shape()[d].is_static())
        return invalid_argument("cuda: value " + value_label(v) + " has symbolic dim " +
                                std::to_string(d) + " ('" + v->shape()[d].str() +
                                "'); artifacts need static shapes (bind it with --sym " +
                                v->shape()[d].str() + "=N)");
    return ok_status();
  }

  Status lower_graph_nodes(const Graph& g);
  Status lower_node(const Node& n);
  Status fold(const Node& n);
  Status weight(const Value* v, const Tensor& t);
  bool pure_pointwise(const Node& fused) const;
  Status pointwise(const std::string& label, const std::vector<const Node*>& nodes,
                   const std::vector<const Value*>& inputs, const std::vector<const Value*>& outputs,
                   const std::vector<int>& in_bufs, const std::vector<int>& out_bufs);
  StatusOr<std::string> op_expr(const Node& n, const std::vector<std::string>& a);
  /// The expression of fused-body member `n` (a scalar constant, an identity or an elementwise
  /// op) from its operands' expressions in `var`.
  StatusOr<std::string> member_expr(const Node& n, const std::unordered_map<const Value*, std::string>& var);
  /// One expression for the single result of pure pointwise fused node `n` (elementwise ops,
  /// identities and scalar constants only) from its operands' expressions `a`.
  StatusOr<std::string> fused_expr(const Node& n, const std::vector<std::string>& a);
  Status strided_copy(const Node& n, int in, int out, const Sizes& out_shape, const Sizes& in_strides,
                      int64_t in_base, const Sizes& out_strides, int64_t out_base, const Sizes& iter);
  Status gather_view(const Node& n, int in, int out, const Sizes& out_shape, const Sizes& strides,
                     int64_t base) {
    return strided_copy(n, in, out, out_shape, strides, base, contiguous_strides(out_shape), 0, out_shape);
  }
  Status reduce(const Node& n);
  /// Whether elementwise node `n` (or a pure pointwise fused node of one result) becomes the
  /// prologue of the reduction that alone reads its result (a gradient's square before a global
  /// norm's sum, its bf16 -> f32 cast included): the reduction computes it on its loads, and no
  /// kernel writes the result. Records it in reduce_prologue_.
  bool defer_to_reduce(const Node& n);
  std::set<const Node*> reduce_prologue_;
  Status arg_reduce(const Node& n);
  Status softmax(const Node& n);
  /// cross_entropy.cpp: a block per row of logits, in their own dtype.
  StatusOr<RowLoss> row_loss(const Node& n);
  Status cross_entropy_rows(const Node& n, const RowLoss& r, bool loss, std::optional<DType> grad_type,
                            const std::vector<int>& args);
  Status cross_entropy_sum(const Node& n, const RowLoss& r, int target, int row_loss, int out);
  Status cross_entropy(const Node& n);  // and cross_entropy_with_grad
  Status cross_entropy_grad(const Node& n);
  /// attention (attention.cpp): one flash-attention kernel per node.
  Status attention(const Node& n);
  /// Whether f32 attention can take the register-tiled kernel (attention_f32.cpp): head dims,
  /// 16-byte aligned rows of q, k, v and y (bufs: q, k, v[, mask], y), shared memory.
  bool f32_tiled_fits(int64_t d, int64_t dv, const std::vector<Sizes>& qkvy, const std::vector<int>& bufs) const;
  /// A transpose [B, S, H, D] -> [B, H, S, D] whose every user is an attention's q/k/v: no copy,
  /// the attention reads the input through strides (bhs_strides_) (attention.cpp).
  bool fold_attention_transpose(const Node& n);
  Status norm(const Node& n);
  Status batch_norm(const Node& n);
  Status matmul(const Node& n);
  Status linear(const Node& n);
  /// c + a @ b as one GEMM with beta 1 (bf16/f16 a and b into an f32 c: mixed dtypes), in place
  /// in c's buffer when nothing else reads c.
  Status matmul_acc(const Node& n);
  /// linear/matmul with at most 16 rows as one generated GEMV kernel (gemv.cpp); false when
  /// the node is not eligible and should go to cuBLASLt.
  StatusOr<bool> small_m_gemm(const Node& n);
  /// What a GEMM step absorbs from the users of its result (gemm_epilogue.cpp): the epilogue
  /// name, extra step fields (bias=, c= ldc=), beta, the buffers they use, and whether a bias
  /// add was absorbed (matmul then folds its batch into M).
  struct GemmEpilogue {
    std::string epilogue = "none", extra;
    double beta = 0;
    std::vector<int> used;
    bool bias = false, absorbed_bias = false;
  };
  /// Absorbs, in this order, a bias add (when !has_bias and bias_ok), then a relu/tanh-gelu or
  /// else a same-shape residual add (as C with beta 1), each only as the sole user.
  GemmEpilogue gemm_epilogue(const Value* v, int out, bool has_bias, bool bias_ok);
  /// The other operand of `v`'s sole user when that is an add of v's shape and dtype whose other
  /// operand already has a buffer and satisfies `fits`; nullptr otherwise.
  const Value* sole_add_operand(const Value* v, bool (*fits)(const Value* v, const Value* other)) const;
  /// A reduce_sum over every dim but the last whose input a later 2-D matmul of the same graph
  /// reads as its A transposed or as its B (a linear's bias and weight gradients): the matmul
  /// lowers it (bias_grad.cpp), deferred to the matmul when every reader of the sum comes after
  /// it, else with the matmul lowered here when its operands are views of lowered values. True
  /// when the reduction needs no lowering where it stands.
  StatusOr<bool> bias_grad_by_gemm(const Node& reduce);
  /// Appends to `chain`, in order, the views and 2-D transposes between `v` and a lowered value;
  /// false when v derives from anything else.
  bool views_to_lowered(const Value* v, std::vector<const Node*>& chain) const;
  /// Lowers matmul `mm`, to which a reduction was deferred: its GEMM step computes the sum as its
  /// bias-gradient epilogue when the step allows one (take_bias_grad), else the reduction is
  /// lowered right after it.
  Status lower_with_bias_grad(const Node& mm);
  /// Gives the GEMM step of the matmul being lowered the deferred sum as its epilogue
  /// (bgrad_a: A's sum over k, or bgrad_b: B's) when it has no other epilogue, no batch and
  /// sizes cuBLASLt's bias-gradient kernels take.
  void take_bias_grad(const Node& mm, GemmEpilogue& ep, int64_t m, int64_t nn, int64_t k, int64_t batch);
  /// The sum or mean (`fin` finishes the f32 sum `acc`) over the rows of float buffer `x` read as
  /// [rows, cols], into `out`, with 16-byte loads and a deterministic second pass over row chunks
  /// (column_reduce.cpp); false when the dtype, alignment or columns do not fit the vectors.
  StatusOr<bool> column_sum(const Node& n, int x, int64_t rows, int64_t cols, const std::string& fin, int out);
  /// A transpose of the last two dims whose every user is a matmul that can read it as
  /// trans_a/trans_b: no copy, the result names the input's buffer (gemm_epilogue.cpp).
  bool fold_transpose(const Node& n);
  /// A fused row group (fuse-rows: row reductions with their elementwise prologue and
  /// epilogue) as one kernel (fused_rows.cpp); false when the body needs node-by-node lowering.
  StatusOr<bool> fused_rows(const Node& fused);
  /// A fused pointwise group holding data-movement ops (transpose, slice, concat, expand,
  /// views) as one kernel over its outputs' index space (pointwise_index.cpp); false when the
  /// body does not qualify and needs node-by-node lowering.
  StatusOr<bool> indexed_pointwise(const Node& fused);
  Status conv(const Node& n);
  /// conv as one cuDNN plan step (conv_cudnn.cpp) absorbing a residual add and a relu; false
  /// when the conv is not eligible (option conv=gemm, asymmetric pads, other dtypes or ranks).
  StatusOr<bool> conv_cudnn(const Node& n);
  /// A 2-D f32 conv over at most 4 input channels (an RGB stem) as an implicit GEMM on TF32
  /// tensor cores (conv_stem.cpp) when the pipeline allows TF32, absorbing a relu; false when
  /// not eligible.
  StatusOr<bool> conv_stem(const Node& n);
  /// Whether `n` is a float conv with a 1x1 kernel, unit strides, no padding and one group (conv_1x1.cpp).
  static bool is_pointwise_conv(const Node& n);
  /// A 1x1 conv as one strided-batched cuBLASLt GEMM over the images (conv_1x1.cpp): a constant
  /// bias as C (a broadcast plane shared by the images), a residual add as C or with the bias
  /// through a kernel writing z + bias first, a relu as the epilogue; false when not eligible or
  /// option conv1x1=cudnn.
  StatusOr<bool> conv_1x1(const Node& n);
  /// Whether `n` is a 1-D or 2-D float conv with groups == input channels (conv_depthwise.cpp).
  static bool is_depthwise(const Node& n);
  /// A depthwise conv as one generated kernel (conv_depthwise.cpp) with its bias and the pointwise
  /// ops after it (conv_tail); false when not eligible or option depthwise=cudnn.
  StatusOr<bool> conv_depthwise(const Node& n);
  /// A pointwise node a channels-last depthwise conv applies to its input loads, and the
  /// device lambda `pro(float) -> float` that computes it.
  struct ConvPrologue {
    const Node* node = nullptr;
    std::string code;
  };
  /// The same for a channels-last depthwise conv (layout = "nhwc"; conv_depthwise_nhwc.cpp),
  /// applying `prologue` (when given) to each input it stages.
  StatusOr<bool> conv_depthwise_nhwc(const Node& n, const ConvPrologue* prologue = nullptr);
  /// What a conv kernel applies to each output `v` (f32 registers) before storing it: `code`
  /// (statements that may read the kernel's coordinates `coords`, one per result dim), the
  /// kernel parameters it reads (after the conv's own) and their buffers, and the absorbed ops.
  struct ConvTail {
    std::string code, params;
    std::vector<int> args;
    std::vector<std::string> ops;
    const Value* value = nullptr;  // what the kernel stores: the last absorbed op's result
  };
  /// Absorbs, one after another, each sole user of the conv's result that a kernel can apply per
  /// element: an inference batch_norm, an elementwise op, or a fuse-pointwise group, whose other
  /// operands already have buffers and broadcast to the result (conv_tail.cpp). Their results
  /// then live in `out`.
  StatusOr<ConvTail> conv_tail(const Node& conv, int out, const std::vector<std::string>& coords);
  /// Appends `nodes` (pointwise, operands named in `names`) computed on registers named
  /// prefix0, prefix1, ... to `code`; false when one has no register form (conv_tail.cpp).
  bool register_code(const std::vector<const Node*>& nodes, std::map<const Value*, std::string>& names,
                     std::string& code, int& next, const std::string& prefix);
  /// Whether pointwise node `n` (one input of its result's shape) becomes the prologue of the
  /// channels-last grouped conv that alone reads it; records it in prologue_ (conv_tail.cpp).
  bool defer_to_conv_prologue(const Node& n);
  /// The device lambda `pro(float) -> float` computing `nodes` (those of pointwise node `pro`)
  /// on a loaded input; nullopt when one has no register form.
  std::optional<std::string> conv_prologue(const Node& pro, const std::vector<const Node*>& nodes);
  /// The depthwise kernel of either layout (conv_depthwise.cpp): its text with the tail's code
  /// and `prologue` applied to each staged input, and its launch reading x (the prologue node's
  /// input when given), w, the bias (or w again), the tail's operands and writing the result.
  Status emit_depthwise(const Node& n, const DepthwiseGeometry& g, const DepthwiseTiles& tl,
                        const ConvPrologue* prologue);
  /// A reduce_mean or reduce_sum over exactly the spatial dims of channels-last `v` (a
  /// squeeze-excite block's global pool) that the depthwise kernel storing `v` can compute from
  /// its registers; nullptr when none.
  const Node* spatial_pool_of(const Value* v) const;
  /// FP8 (fp8.cpp): quantize/dequantize kernels and scaled_matmul as a cuBLASLt FP8 GEMM.
  Status quantize(const Node& n);
  Status requantize(const Node& n);
  Status dequantize(const Node& n);
  /// One quantize kernel: f8 q (dtype qt) = x (dtype xt) / scale, count elements; with `amax` it
  /// also folds max |x| into that f32 buffer (zeroed by a memset step first); with
  /// `unless_scale` every thread returns at once while that scale's bits equal scale's.
  struct QuantizeKernel {
    std::string name = "quantize";
    DType xt = DType::kF32, qt = DType::kF8E4M3FN;
    int x = -1, scale = -1, q = -1, amax = -1, unless_scale = -1;
    int64_t count = 0;
    /// >= 0: a requantize whose scale is a delayed_scaling_step_scale computed by this kernel
    /// (each block; block 0 stores it here) from `scale` (the delayed one) and step_scale's
    /// amax and history.
    int step_scale = -1, step_amax = -1, step_history = -1;
    int64_t history = 0;
    float factor = 1.0f;
  };
  Status quantize_kernel(const Node& n, const QuantizeKernel& k);
  /// Quantize node `q`'s kernel: its input, scale and result.
  QuantizeKernel quantize_of(const Node& q);
  /// Quantize node `q` as one kernel, reducing amax node `a` (of the same input) as it goes.
  Status quantize_with_amax(const Node& q, const Node& a);
  /// A top-level `op` node (amax, quantize) of n's graph reading n's operand 0 as its own
  /// operand 0, not lowered yet, whose other operands are made already: one kernel can do both.
  const Node* standalone_partner(const Node& n, const std::string& op) const;
  Status scaled_matmul(const Node& n);
  /// matmul_int4 (int4.cpp): GEMV for M <= 8, mma.sync for M <= 64, else dequantize + gemm.
  Status matmul_int4(const Node& n);
  /// Reorders the nibbles of each 32-bit word of INT4 weight buffer `id` in place, to values
  /// 0 2 4 6 1 3 5 7 (the streaming kernel's WPRE layout); once per buffer.
  void reorder_int4_words(int id);
  std::set<int> reordered_int4_;  // weight buffers reorder_int4_words has rewritten
  /// Adds cuda_fp8.h and the conversion helper to the source once.
  void need_fp8();
  /// A weight buffer holding `t` that no graph value names.
  int host_weight(const Tensor& t);
  /// The bytes of a weight buffer (or an alias of one) as a tensor; nullopt for other buffers.
  std::optional<Tensor> weight_tensor(int id) const;
  /// Launches y = q * scale[0] over `shape` into `out` (a new activation when -1); returns `out`.
  StatusOr<int> dequant_kernel(const Node& n, int q, DType qt, int scale, DType out_t, const Sizes& shape, int out);
  /// Persistent state and amax (state.cpp): variable = a weights-section buffer read in place,
  /// assign = recorded here and emitted by finish_state as a copy at the end of the plan.
  Status state_op(const Node& n);
  /// amax as one reduction kernel (atomicMax on |x|'s f32 bits into a zeroed f32[]).
  Status amax(const Node& n);
  /// FP8 delayed scaling's history roll and next scale: recorded here, and every one whose
  /// results only its own variables' assigns take is written in place by one kernel for all of
  /// them at the end of the plan (finish_state); any other runs at once, into activations.
  Status delayed_scaling_update(const Node& n);
  struct ScaleUpdate {
    int amax = -1, hist_in = -1, hist_out = -1, scale_in = -1, scale_out = -1, due = -1;
    int64_t history = 1;
    float factor = 1.0f;
    bool use_max = true;
  };
  std::vector<ScaleUpdate> scale_updates_;
  /// delayed_scaling_step_scale: computed by the requantize kernel that reads it when every
  /// other reader comes after that requantize (recorded here by the node), else one small kernel.
  Status delayed_scaling_step_scale(const Node& n);
  std::set<const Node*> step_scales_in_requantize_;
  /// The f32 factor 2^margin / max_finite(dtype) of a delayed_scaling_update or _step_scale node.
  static float delayed_scale_factor(const Node& n);
  void need_delayed_scaling();
  bool delayed_scaling_device_ = false;  // kiln_delayed_scaling and kiln_step_scale are in the source
  /// Launches one kernel for `updates`, a block each.
  void scale_update_kernel(const std::vector<ScaleUpdate>& updates);
  /// After the output copies: one copy step per assign, then the variables' buffers become
  /// plain weights in the plan.
  Status finish_state();
  struct Assign {
    std::string name;
    int src = -1;
    const Node* node = nullptr;
  };
  std::vector<Assign> assigns_;
  std::map<std::string, int> variables_;  // variable name -> its buffer
  std::map<std::string, std::string> copy_of_;  // a weight's low-precision copy -> the weight (variable copy_of)
  /// What an elementwise kernel step reads and writes (pointwise): the (input, output) root
  /// buffer pairs where each thread reads the input only at the element of the output it
  /// writes and computes that output from it, and the roots it reads at other elements.
  struct ElementwiseAccess {
    std::set<std::pair<int, int>> same_element;
    std::set<int> other_reads;
  };
  std::map<size_t, ElementwiseAccess> elementwise_steps_;  // by step index
  /// Makes the value of each assign that a kernel computes elementwise from the variable's old
  /// value (AdamW's new weight and moments) live in the variable's buffer, when no later step
  /// reads the old value: no copy at the end of the plan. Returns the assigns it placed.
  std::set<const Node*> write_assigns_in_place();
  /// Per-rank programs (collective.cpp): collective ops as `step collective` (packing dims
  /// other than the outermost with strided copies) and local_shard; the mesh line and the
  /// input and output placements of the plan; the blocks of rank-dependent weights, placed
  /// in the weights section after drop_unread_weights.
  static bool is_collective(const std::string& op);
  Status collective(const Node& n);
  Status collective_step(const Node& n, const std::string& fields, std::vector<int> used);
  Status local_shard(const Node& n);
  void record_mesh(const Graph& g);
  std::string io_placement(bool input, size_t i) const;
  void place_rank_weights();
  bool per_rank_ = false;
  std::string mesh_line_;  // "mesh dp=2 tp=2", "" for a single-device plan
  std::vector<std::string> input_placements_, output_placements_;
  std::vector<std::pair<int, std::string>> rank_blocks_;  // rank_weight buffer -> every rank's block
  Status conv_gemm(const Node& n);
  Status pool(const Node& n);
  Status gather(const Node& n);
  Status scatter_add(const Node& n);
  /// `v` is a broadcast zero that only scatter_adds read as their data: it needs no buffer.
  bool zeros_for_scatter(const Value* v) const;
  Status pad(const Node& n);
  Status gemm_operand(const Node& n, const Value* v, const Sizes& batch_dims, int64_t rows,
                      int64_t cols, int& id, int64_t& stride);
  std::string write_plan(int64_t arena);
  int64_t plan_memory();
  /// Leaves out of the weights section every weight no step reads (e.g. scales and zeros the
  /// INT4 kernel reads packed, FP8 weights dequantized at compile time): the buffer stays in the
  /// plan, empty (shape 0, 0 bytes). Variables stay.
  void drop_unread_weights();

  LoweringOptions opts_;
  std::vector<Buffer> bufs_;
  std::unordered_map<const Value*, int> val_;
  std::set<const Node*> absorbed_;  // activations a GEMM epilogue already applies
  /// Channels-last depthwise convs -> the pointwise node before them (their input's only
  /// producer and user) that the conv kernel applies to each input it loads instead of a
  /// kernel of its own: an expand GEMM's SiLU then costs no round trip through memory.
  std::map<const Node*, ConvPrologue> prologue_;
  std::set<const Value*> transposed_;  // transposes a matmul reads with trans_a/trans_b
  /// A reduction deferred to the GEMM of a matmul (bias_grad.cpp): the sum of its operand 0 or 1.
  struct BiasGrad {
    const Node* reduce = nullptr;
    int operand = -1;
  };
  std::map<const Node*, BiasGrad> bias_grad_;  // matmul -> the reduction deferred to it
  BiasGrad pending_bias_grad_;                 // the matmul being lowered may take this one
  std::unordered_map<const Node*, size_t> bias_grad_order_;  // node positions of bias_grad_order_graph_
  const Graph* bias_grad_order_graph_ = nullptr;
  std::unordered_map<const Value*, Sizes> bhs_strides_;  // attention operands read strided: b, h, s
  std::vector<Step> steps_;
  std::vector<std::string> kernels_;
  std::string source_, weights_;
  std::vector<std::pair<std::string, int>> inputs_, outputs_;
  bool fp16_ = false, bf16_ = false, gemm_ = false;
  bool fp8_ = false;  // cuda_fp8.h is in the source
};

}  // namespace kiln::cuda::detail
