// Lowering of cross_entropy, cross_entropy_grad and cross_entropy_with_grad: a block per row of
// logits, read in their own dtype (bf16 under autocast) with f32 math, 16-byte loads where the
// row allows. The loss reads each row once (online max and sum, the target's logit) and a
// one-block kernel sums the rows' losses in a fixed order (deterministic, no atomics); the
// gradient reads a row for its log-sum-exp and again (from L2: a 50304-wide bf16 row is 100 KB)
// to write exp(x - lse) - onehot. cross_entropy_with_grad (decompose-losses pairs the two when
// the loss's gradient does not depend on the loss, as in a training step) does both in the one
// row kernel: the logits are read from memory once and die with the forward.
#include <cctype>
#include <limits>

#include "lowerer.h"

namespace kiln::cuda::detail {
namespace {

/// The online max/sum over row `row` of `x` into `m` and `s` (block-wide), as Lowerer::softmax
/// computes them: -inf elements add nothing, a +inf max gives a nan sum.
std::string online_max_sum(const RowLoss& r) {
  const std::string ninf = literal(r.acc_type, -std::numeric_limits<double>::infinity());
  std::string c = "    acc mt = " + ninf + ", st = 0;\n";
  const std::string step = "if (v > mt) { st = st * exp(mt - v) + 1; mt = v; } else if (v != " + ninf +
                           ") st += exp(v - mt);";
  if (r.vec > 1) {
    c += "    for (long long q = threadIdx.x; q < " + int_literal(r.len / r.vec) + "; q += blockDim.x) {\n";
    c += "      const " + vector_type(16) + " raw = reinterpret_cast<const " + vector_type(16) + "*>(x + base)[q];\n";
    c += "      const " + r.x_storage + "* e = reinterpret_cast<const " + r.x_storage + "*>(&raw);\n";
    c += "#pragma unroll\n      for (int k = 0; k < " + std::to_string(r.vec) + "; ++k) {\n";
    c += "        const acc v = (acc)" + load_expr(r.x_type, "e[k]") + ";\n        " + step + "\n      }\n    }\n";
  } else {
    c += "    for (long long j = threadIdx.x; j < " + int_literal(r.len) + "; j += blockDim.x) {\n";
    c += "      const acc v = (acc)" + load_expr(r.x_type, "x[base + j]") + ";\n      " + step + "\n    }\n";
  }
  c += "    const acc m = kiln_block_reduce(mt, " + ninf + ", mx);\n";
  c += "    acc s = kiln_block_reduce(mt == " + ninf + " ? st : st * exp(mt - m), (acc)0, sum);\n";
  c += "    if (m == " + literal(r.acc_type, std::numeric_limits<double>::infinity()) + ") s = " +
       literal(r.acc_type, std::numeric_limits<double>::quiet_NaN()) + ";\n";
  return c;
}

/// The accumulator type `acc` (f32, f64 for f64 logits) and the block reductions' combiners.
/// `code` with f32's expf/logf where the accumulator is f32 (the generic spellings would be f64).
std::string with_math(const RowLoss& r, std::string code) {
  if (r.acc_type == DType::kF64) return code;
  for (const char* fn : {"exp(", "log("}) {
    const std::string from = fn, to = from.substr(0, 3) + "f(";
    for (size_t at = code.find(from); at != std::string::npos; at = code.find(from, at + to.size()))
      if (at == 0 || (!std::isalnum(static_cast<unsigned char>(code[at - 1])) && code[at - 1] != '_'))
        code.replace(at, from.size(), to);
  }
  return code;
}

std::string acc_name(const RowLoss& r) { return r.acc_type == DType::kF64 ? "double" : "float"; }

std::string preamble(const RowLoss& r) {
  return std::string("  typedef ") + (r.acc_type == DType::kF64 ? "double" : "float") + " acc;\n" +
         "  auto mx = [](acc a, acc b) -> acc { return b > a ? b : a; };\n"
         "  auto sum = [](acc a, acc b) -> acc { return a + b; };\n";
}

}  // namespace

StatusOr<RowLoss> Lowerer::row_loss(const Node& n) {
  const Value *x = n.operand(0), *t = n.operand(1);
  RowLoss s;
  s.x_type = x->dtype();
  s.acc_type = x->dtype() == DType::kF64 ? DType::kF64 : DType::kF32;
  const Sizes xs = sizes_of(x);
  s.len = xs.back();
  s.rows = product(sizes_of(t));
  if (s.rows * s.len != product(xs)) return unsupported(n, "targets must have the logits' leading dims");
  KILN_ASSIGN_OR_RETURN(s.x_storage, storage(n, x->dtype()));
  KILN_ASSIGN_OR_RETURN(s.t_storage, storage(n, t->dtype()));
  if (!is_float(x->dtype()) || dtype_bits(x->dtype()) < 16) return unsupported_dtype(n, x->dtype());
  const int64_t width = 16 / (dtype_bits(x->dtype()) / 8);
  s.vec = s.len % width == 0 && aligned16(buf(x)) ? width : 1;
  return s;
}

/// The row kernel: per row the online max and sum, then the row's loss (into row_loss, when
/// `loss`) and the gradient (into g, when `gt` is set: (exp(x - lse) - onehot) * dloss, a padded
/// column -1e30 or -inf getting exp(...) = 0 exactly, so gradient 0). An ignored row gets loss 0
/// and a zero gradient without its logits being read; a target that is no class gives nan (the
/// reference refuses it, a kernel cannot).
Status Lowerer::cross_entropy_rows(const Node& n, const RowLoss& r, bool loss, std::optional<DType> gt,
                                   const std::vector<int>& args) {
  const std::string ignore = int_literal(n.get_int("ignore_index")), L = int_literal(r.len);
  const std::string nan = literal(r.acc_type, std::numeric_limits<double>::quiet_NaN());
  std::string params = "const " + r.x_storage + "* __restrict__ x, const " + r.t_storage + "* __restrict__ target";
  std::string body = preamble(r), skip;
  if (gt) {
    KILN_ASSIGN_OR_RETURN(std::string dst, storage(n, n.operand(2)->dtype()));
    KILN_ASSIGN_OR_RETURN(std::string gst, storage(n, *gt));
    KILN_RETURN_IF_ERROR(reg(n, *gt).status());
    params += ", const " + dst + "* __restrict__ dloss, " + gst + "* __restrict__ g";
    body += "  const acc dl = (acc)" + load_expr(n.operand(2)->dtype(), "dloss[0]") + ";\n";
    skip += "      for (long long j = threadIdx.x; j < " + L + "; j += blockDim.x) g[base + j] = " + store_expr(*gt, "(acc)0") + ";\n";
  }
  if (loss) {
    params += ", " + acc_name(r) + "* __restrict__ row_loss";
    skip += "      if (threadIdx.x == 0) row_loss[row] = 0;\n";
  }
  body += "  for (long long row = blockIdx.x; row < " + int_literal(r.rows) + "; row += gridDim.x) {\n";
  body += "    const long long base = row * " + L + ", t = (long long)target[row];\n";
  body += "    if (t == " + ignore + ") {\n" + skip + "      continue;\n    }\n";
  body += online_max_sum(r);
  body += "    const acc lse = m + log(s);\n";
  body += "    const bool is_class = t >= 0 && t < " + L + ";\n";
  if (loss)
    body += "    if (threadIdx.x == 0) row_loss[row] = is_class ? lse - (acc)" + load_expr(r.x_type, "x[base + t]") + " : " +
            nan + ";\n";
  if (gt) {
    const std::string grad = "(exp(v - lse) - (j == t ? (acc)1 : (acc)0)) * scale";
    KILN_ASSIGN_OR_RETURN(std::string gst, storage(n, *gt));
    body += "    const acc scale = is_class ? dl : " + nan + ";\n";
    if (r.vec > 1) {
      const std::string packed = vector_type(r.vec * (dtype_bits(*gt) / 8));
      body += "    for (long long q = threadIdx.x; q < " + int_literal(r.len / r.vec) + "; q += blockDim.x) {\n";
      body += "      const " + vector_type(16) + " raw = reinterpret_cast<const " + vector_type(16) + "*>(x + base)[q];\n";
      body += "      const " + r.x_storage + "* e = reinterpret_cast<const " + r.x_storage + "*>(&raw);\n";
      body += "      " + packed + " packed;\n";
      body += "      " + gst + "* o = reinterpret_cast<" + gst + "*>(&packed);\n";
      body += "#pragma unroll\n      for (int k = 0; k < " + std::to_string(r.vec) + "; ++k) {\n";
      body += "        const long long j = q * " + std::to_string(r.vec) + " + k;\n";
      body += "        const acc v = (acc)" + load_expr(r.x_type, "e[k]") + ";\n";
      body += "        o[k] = " + store_expr(*gt, grad) + ";\n      }\n";
      body += "      reinterpret_cast<" + packed + "*>(g + base)[q] = packed;\n    }\n";
    } else {
      body += "    for (long long j = threadIdx.x; j < " + L + "; j += blockDim.x) {\n";
      body += "      const acc v = (acc)" + load_expr(r.x_type, "x[base + j]") + ";\n";
      body += "      g[base + j] = " + store_expr(*gt, grad) + ";\n    }\n";
    }
  }
  body += "  }\n";
  const std::string name = kernel_name(!gt ? "cross_entropy_rows" : loss ? "cross_entropy_with_grad" : "cross_entropy_grad");
  add_kernel(name, params, with_math(r, body));
  launch(name, r.rows, args);
  return ok_status();
}

/// The rows' losses summed (divided by the counted rows for the mean) in one block, in a fixed
/// order: deterministic, no atomics.
Status Lowerer::cross_entropy_sum(const Node& n, const RowLoss& r, int target, int row_loss, int out) {
  const DType yt = n.result(0)->dtype();
  KILN_ASSIGN_OR_RETURN(std::string yst, storage(n, yt));
  KILN_RETURN_IF_ERROR(reg(n, yt).status());
  const bool mean = n.get_string("reduction") == "mean";
  std::string fin = preamble(r);
  fin += "  acc total = 0, counted = 0;\n";
  fin += "  for (long long i = threadIdx.x; i < " + int_literal(r.rows) + "; i += blockDim.x)\n";
  fin += "    if ((long long)target[i] != " + int_literal(n.get_int("ignore_index")) +
         ") { total += row_loss[i]; counted += 1; }\n";
  fin += "  total = kiln_block_reduce(total, (acc)0, sum);\n";
  fin += "  counted = kiln_block_reduce(counted, (acc)0, sum);\n";
  fin += "  if (threadIdx.x == 0) y[0] = " + store_expr(yt, mean ? "total / counted" : "total") + ";\n";
  const std::string name = kernel_name("cross_entropy_sum");
  add_kernel(name, "const " + r.t_storage + "* __restrict__ target, const " + acc_name(r) + "* __restrict__ row_loss, " +
                       yst + "* __restrict__ y", fin);
  launch(name, 1, {target, row_loss, out});
  return ok_status();
}

Status Lowerer::cross_entropy(const Node& n) {
  KILN_ASSIGN_OR_RETURN(RowLoss r, row_loss(n));
  const bool grad = n.op_name() != "cross_entropy";  // cross_entropy_with_grad
  const int t = buf(n.operand(1));
  const int row_loss = add_buffer("activation", r.acc_type, {r.rows});
  const int loss = activation_for(n.result(0));
  std::vector<int> args = {buf(n.operand(0)), t};
  if (grad) {
    const int g = activation_for(n.result(1));
    if (r.vec > 1 && !aligned16(g)) r.vec = 1;
    args.insert(args.end(), {buf(n.operand(2)), g});
  }
  args.push_back(row_loss);
  if (r.rows > 0 && r.len > 0)
    KILN_RETURN_IF_ERROR(cross_entropy_rows(n, r, true, grad ? std::optional(n.result(1)->dtype()) : std::nullopt, args));
  return cross_entropy_sum(n, r, t, row_loss, loss);
}

Status Lowerer::cross_entropy_grad(const Node& n) {
  KILN_ASSIGN_OR_RETURN(RowLoss r, row_loss(n));
  const int g = activation_for(n.result());
  if (r.vec > 1 && !aligned16(g)) r.vec = 1;
  if (r.rows == 0 || r.len == 0) return ok_status();
  return cross_entropy_rows(n, r, false, n.result()->dtype(), {buf(n.operand(0)), buf(n.operand(1)), buf(n.operand(2)), g});
}

}  // namespace kiln::cuda::detail
