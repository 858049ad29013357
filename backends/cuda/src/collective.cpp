// Lowering of per-rank programs: collective ops to `step collective` plan steps run by the
// runtime through NCCL (with packing kernels where a dim other than the outermost is gathered,
// scattered or exchanged), local_shard to this rank's block (a weight sliced at compile time
// into one block per rank, of which each rank uploads its own; an activation copied through a
// rank-dependent view), and the plan's mesh line and input/output placements.
#include <cstring>

#include "kiln/ir/mesh_run.h"
#include "lowerer.h"

namespace kiln::cuda::detail {

namespace {

/// "R,S(0),P(sum)" as the plan writes a placement ("" when not annotated).
std::string plan_placement(const Sharding& s) {
  std::string out;
  for (const Placement& p : s) out += (out.empty() ? "" : ",") + p.str();
  return out;
}

int64_t prod(const Sizes& s, size_t begin, size_t end) {
  int64_t n = 1;
  for (size_t i = begin; i < end && i < s.size(); ++i) n *= s[i];
  return n;
}

}  // namespace

bool Lowerer::is_collective(const std::string& op) {
  static const std::set<std::string> kOps = {"all_reduce", "all_gather", "reduce_scatter",
                                             "all_to_all", "broadcast",  "send",
                                             "recv",       "local_shard"};
  return kOps.count(op) > 0;
}

void Lowerer::record_mesh(const Graph& g) {
  per_rank_ = g.is_per_rank() && !g.mesh().empty();
  if (!per_rank_) return;
  mesh_line_ = "mesh";
  for (const DeviceMesh::Axis& a : g.mesh().axes)
    mesh_line_ += " " + a.name + "=" + std::to_string(a.size);
  for (int i = 0; i < g.num_inputs(); ++i)
    input_placements_.push_back(plan_placement(g.input(i)->sharding()));
  for (int i = 0; i < g.num_outputs(); ++i)
    output_placements_.push_back(plan_placement(g.output(i)->sharding()));
}

std::string Lowerer::io_placement(bool input, size_t i) const {
  const auto& list = input ? input_placements_ : output_placements_;
  return i < list.size() && !list[i].empty() ? " placement=" + list[i] : "";
}

void Lowerer::place_rank_weights() {
  for (const auto& [id, blocks] : rank_blocks_) {
    weights_.resize(static_cast<size_t>(align_up(static_cast<int64_t>(weights_.size()))), '\0');
    bufs_[id].offset = static_cast<int64_t>(weights_.size());
    bufs_[id].kind = "weight";  // from here on only the plan reads it, with its rank_axis
    weights_ += blocks;
  }
}

Status Lowerer::collective_step(const Node& n, const std::string& fields, std::vector<int> used) {
  steps_.push_back({"step collective op=" + n.op_name() + " " + fields, std::move(used)});
  return ok_status();
}

Status Lowerer::collective(const Node& n) {
  const std::string& op = n.op_name();
  if (!per_rank_)
    return unsupported(
        n, "collective ops run only in a per-rank program (a graph over a mesh, marked per_rank)");
  if (op == "local_shard") return local_shard(n);
  const std::string dtype = dname(op == "recv" ? n.result()->dtype() : n.operand(0)->dtype());
  if (op == "send" || op == "recv") {
    const Value* v = op == "send" ? n.operand(0) : n.result();
    const int b = op == "send" ? buf(v) : activation_for(v);
    return collective_step(n,
                           std::string(op == "send" ? "x" : "y") + "=b" + std::to_string(b) +
                               " count=" + std::to_string(product(sizes_of(v))) +
                               " dtype=" + dtype + " peer=" + std::to_string(n.get_int("peer")) +
                               " tag=" + std::to_string(n.get_int("tag")) +
                               (n.get_string("axis", "").empty() ? "" : " axis=" + n.get_string("axis")),
                           {b});
  }
  const DeviceMesh& mesh = n.graph()->mesh();
  const int a = mesh.axis_index(n.get_string("axis"));
  if (a < 0) return unsupported(n, "the mesh has no axis '" + n.get_string("axis") + "'");
  const int64_t k = mesh.axes[static_cast<size_t>(a)].size;
  const std::string axis = " axis=" + n.get_string("axis");
  const Value* xv = n.operand(0);
  const Sizes xs = sizes_of(xv), ys = sizes_of(n.result());
  const int x = buf(xv);
  const auto count = [](int64_t c) { return " count=" + std::to_string(c); };
  const auto ref = [](const char* key, int id) {
    return std::string(" ") + key + "=b" + std::to_string(id);
  };
  const bool reduces = op == "all_reduce" || op == "reduce_scatter";
  static const std::set<DType> kReducible = {
      DType::kF64,    DType::kF32, DType::kF16, DType::kBF16, DType::kF8E4M3FN,
      DType::kF8E5M2, DType::kI64, DType::kI32, DType::kI8,   DType::kU8};
  if (reduces && !kReducible.count(xv->dtype()))
    return unsupported(n, "NCCL cannot reduce " + dtype +
                              " (f64, f32, f16, bf16, f8e4m3fn, f8e5m2, i64, i32, i8 or u8)");
  const std::string reduce = reduces ? " reduce=" + n.get_string("reduce") : "";
  if (op == "all_reduce" || op == "broadcast") {
    const int y = activation_for(n.result());
    const std::string root = op == "broadcast" ? " root=" + std::to_string(n.get_int("root")) : "";
    return collective_step(
        n,
        (axis + ref("x", x) + ref("y", y) + count(product(xs)) + " dtype=" + dtype + reduce + root)
            .substr(1),
        {x, y});
  }
  // The others move blocks along a dim: NCCL moves whole contiguous blocks, so a dim with
  // larger dims outside it is packed into (or unpacked from) rank-major order by a kernel.
  const bool sub_byte = dtype_bits(xv->dtype()) < 8;
  const auto rank_major = [&](const char* what) -> Status {
    return sub_byte ? unsupported(n, std::string(what) + " of " + dtype + " along an inner dim")
                    : ok_status();
  };
  if (op == "all_gather") {
    const size_t d =
        static_cast<size_t>(norm_axis(n.get_int("dim"), static_cast<int64_t>(xs.size())));
    const int y = activation_for(n.result());
    const int64_t outer = prod(xs, 0, d), len = xs[d], inner = prod(xs, d + 1, xs.size());
    if (outer == 1)
      return collective_step(
          n, (axis + ref("x", x) + ref("y", y) + count(product(xs)) + " dtype=" + dtype).substr(1),
          {x, y});
    KILN_RETURN_IF_ERROR(rank_major("all_gather"));
    const int tmp = add_buffer("activation", xv->dtype(), {k, product(xs)});
    KILN_RETURN_IF_ERROR(collective_step(
        n, (axis + ref("x", x) + ref("y", tmp) + count(product(xs)) + " dtype=" + dtype).substr(1),
        {x, tmp}));
    // y[o, r * len + l, i] = tmp[r, o, l, i]
    return strided_copy(n, tmp, y, ys, {len * inner, outer * len * inner, inner, 1}, 0,
                        {k * len * inner, len * inner, inner, 1}, 0, {outer, k, len, inner});
  }
  if (op == "reduce_scatter") {
    const size_t d =
        static_cast<size_t>(norm_axis(n.get_int("dim"), static_cast<int64_t>(xs.size())));
    const int y = activation_for(n.result());
    const int64_t outer = prod(xs, 0, d), len = ys[d], inner = prod(xs, d + 1, xs.size());
    int src = x;
    if (outer != 1) {
      KILN_RETURN_IF_ERROR(rank_major("reduce_scatter"));
      // tmp[r, o, l, i] = x[o, r * len + l, i]
      src = add_buffer("activation", xv->dtype(), {product(xs)});
      KILN_RETURN_IF_ERROR(
          strided_copy(n, x, src, {product(xs)}, {len * inner, k * len * inner, inner, 1}, 0,
                       {outer * len * inner, len * inner, inner, 1}, 0, {k, outer, len, inner}));
    }
    return collective_step(
        n,
        (axis + ref("x", src) + ref("y", y) + count(product(ys)) + " dtype=" + dtype + reduce)
            .substr(1),
        {src, y});
  }
  // all_to_all: block r of x along split_dim goes to group rank r; what arrives from rank r
  // becomes block r of y along concat_dim.
  const size_t s =
      static_cast<size_t>(norm_axis(n.get_int("split_dim"), static_cast<int64_t>(xs.size())));
  const size_t c =
      static_cast<size_t>(norm_axis(n.get_int("concat_dim"), static_cast<int64_t>(xs.size())));
  Sizes block = xs;
  block[s] /= k;
  const int64_t block_elems = product(block);
  Sizes iter = {k}, packed = contiguous_strides(block);
  iter.insert(iter.end(), block.begin(), block.end());
  packed.insert(packed.begin(), block_elems);
  const int y = activation_for(n.result());
  int send = x, recv = y;
  if (prod(xs, 0, s) != 1) {
    KILN_RETURN_IF_ERROR(rank_major("all_to_all"));
    Sizes from = contiguous_strides(xs);
    from.insert(from.begin(), block[s] * from[s]);
    send = add_buffer("activation", xv->dtype(), {k * block_elems});
    KILN_RETURN_IF_ERROR(strided_copy(n, x, send, {k * block_elems}, from, 0, packed, 0, iter));
  }
  const bool unpack = prod(ys, 0, c) != 1;
  if (unpack) {
    KILN_RETURN_IF_ERROR(rank_major("all_to_all"));
    recv = add_buffer("activation", xv->dtype(), {k * block_elems});
  }
  KILN_RETURN_IF_ERROR(collective_step(
      n,
      (axis + ref("x", send) + ref("y", recv) + count(block_elems) + " dtype=" + dtype).substr(1),
      {send, recv}));
  if (!unpack) return ok_status();
  Sizes to = contiguous_strides(ys);
  to.insert(to.begin(), block[c] * to[c]);
  return strided_copy(n, recv, y, ys, packed, 0, to, 0, iter);
}

Status Lowerer::local_shard(const Node& n) {
  const DeviceMesh& mesh = n.graph()->mesh();
  const std::string axis = n.get_string("axis");
  const int a = mesh.axis_index(axis);
  if (a < 0) return unsupported(n, "the mesh has no axis '" + axis + "'");
  const int64_t k = mesh.axes[static_cast<size_t>(a)].size;
  const Value* xv = n.operand(0);
  const Sizes xs = sizes_of(xv), ys = sizes_of(n.result());
  const size_t d =
      static_cast<size_t>(norm_axis(n.get_int("dim"), static_cast<int64_t>(xs.size())));
  const int64_t len = ys[d];
  if (dtype_bits(xv->dtype()) < 8) return unsupported(n, "local_shard of " + dname(xv->dtype()));
  const int x = buf(xv);
  if (std::optional<Tensor> whole = weight_tensor(x)) {
    // A constant: every rank's block is cut here, and each rank uploads only its own.
    const int id = add_buffer("rank_weight", xv->dtype(), ys, n.result()->name());
    const int64_t stride = align_up(bufs_[id].bytes);
    std::string blocks;
    for (int64_t r = 0; r < k; ++r) {
      KILN_ASSIGN_OR_RETURN(Tensor piece,
                            slice_dim(*whole, static_cast<int64_t>(d), r * len, (r + 1) * len));
      blocks.resize(static_cast<size_t>(r * stride), '\0');
      blocks.append(reinterpret_cast<const char*>(piece.data()), piece.nbytes());
    }
    bufs_[id].rank_axis = axis;
    bufs_[id].rank_stride = stride;
    rank_blocks_.emplace_back(id, std::move(blocks));
    val_[n.result()] = id;
    return ok_status();
  }
  // An activation: a view whose start moves by one block per rank, copied out (strided when
  // dims outside `d` hold more than one block).
  const int64_t esize = dtype_storage_bytes(xv->dtype(), 1);
  const int64_t outer = prod(xs, 0, d), inner = prod(xs, d + 1, xs.size());
  const int r = root(x);
  const int view = add_buffer("alias", xv->dtype(), {((outer - 1) * xs[d] + len) * inner});
  bufs_[view].base = r;
  bufs_[view].offset = x == r ? 0 : bufs_[x].offset;
  bufs_[view].rank_axis = axis;
  bufs_[view].rank_stride = len * inner * esize;
  const int y = activation_for(n.result());
  if (outer == 1) {
    if (bufs_[y].bytes > 0)
      steps_.push_back({"step copy src=b" + std::to_string(view) + " dst=b" + std::to_string(y) +
                            " bytes=" + std::to_string(bufs_[y].bytes),
                        {view, y}});
    return ok_status();
  }
  return strided_copy(n, view, y, ys, {xs[d] * inner, inner, 1}, 0, {len * inner, inner, 1}, 0,
                      {outer, len, inner});
}

}  // namespace kiln::cuda::detail
