// Lowering of cross_entropy and cross_entropy_grad: a block per row of logits, read in their own
// dtype (bf16 under autocast) with f32 math, 16-byte loads where the row allows. The forward
// reads each row once (online max and sum, the target's logit) and a one-block kernel sums the
// rows' losses in a fixed order (deterministic, no atomics); the gradient reads a row for its
// log-sum-exp and again (from L2: a 50304-wide bf16 row is 100 KB) to write exp(x - lse) - onehot.
// They stay two kernels, not one, because the gradient's scale is a graph value (the loss's
// gradient, loss scaling, the mean's count) that the forward does not have yet.
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

Status Lowerer::cross_entropy(const Node& n) {
  KILN_ASSIGN_OR_RETURN(const RowLoss r, row_loss(n));
  const Value *x = n.operand(0), *t = n.operand(1);
  const DType yt = n.result()->dtype();
  KILN_ASSIGN_OR_RETURN(std::string yst, storage(n, yt));
  KILN_RETURN_IF_ERROR(reg(n, yt).status());
  const int out = activation_for(n.result());
  const std::string ignore = int_literal(n.get_int("ignore_index"));
  const std::string nan = literal(r.acc_type, std::numeric_limits<double>::quiet_NaN());
  // Per row: log-sum-exp minus the target's logit; 0 for an ignored row, nan for a target that is
  // no class (the reference refuses it; a kernel cannot).
  const int row_loss = add_buffer("activation", r.acc_type, {r.rows});
  std::string body = preamble(r);
  body += "  for (long long row = blockIdx.x; row < " + int_literal(r.rows) + "; row += gridDim.x) {\n";
  body += "    const long long base = row * " + int_literal(r.len) + ", t = (long long)target[row];\n";
  body += "    if (t == " + ignore + ") { if (threadIdx.x == 0) row_loss[row] = 0; continue; }\n";
  body += online_max_sum(r);
  body += "    if (threadIdx.x == 0)\n      row_loss[row] = t >= 0 && t < " + int_literal(r.len) + " ? m + log(s) - (acc)" +
          load_expr(r.x_type, "x[base + t]") + " : " + nan + ";\n  }\n";
  const std::string rows_kernel = kernel_name("cross_entropy_rows");
  add_kernel(rows_kernel, "const " + r.x_storage + "* __restrict__ x, const " + r.t_storage +
                              "* __restrict__ target, " + acc_name(r) + "* __restrict__ row_loss", with_math(r, body));
  // The rows' sum (and the counted rows for the mean) in one block, in a fixed order.
  const bool mean = n.get_string("reduction") == "mean";
  std::string fin = preamble(r);
  fin += "  acc total = 0, counted = 0;\n";
  fin += "  for (long long i = threadIdx.x; i < " + int_literal(r.rows) + "; i += blockDim.x)\n";
  fin += "    if ((long long)target[i] != " + ignore + ") { total += row_loss[i]; counted += 1; }\n";
  fin += "  total = kiln_block_reduce(total, (acc)0, sum);\n";
  fin += "  counted = kiln_block_reduce(counted, (acc)0, sum);\n";
  fin += "  if (threadIdx.x == 0) y[0] = " + store_expr(yt, mean ? "total / counted" : "total") + ";\n";
  const std::string sum_kernel = kernel_name("cross_entropy_sum");
  add_kernel(sum_kernel, "const " + r.t_storage + "* __restrict__ target, const " + acc_name(r) + "* __restrict__ row_loss, " + yst +
                             "* __restrict__ y", fin);
  if (r.rows == 0) {
    launch(sum_kernel, 1, {buf(t), row_loss, out});
    return ok_status();
  }
  launch(rows_kernel, r.rows, {buf(x), buf(t), row_loss});
  launch(sum_kernel, 1, {buf(t), row_loss, out});
  return ok_status();
}

Status Lowerer::cross_entropy_grad(const Node& n) {
  KILN_ASSIGN_OR_RETURN(RowLoss r, row_loss(n));
  const Value *x = n.operand(0), *t = n.operand(1), *dloss = n.operand(2);
  const DType gt = n.result()->dtype();
  KILN_ASSIGN_OR_RETURN(std::string gst, storage(n, gt));
  KILN_ASSIGN_OR_RETURN(std::string dst, storage(n, dloss->dtype()));
  KILN_RETURN_IF_ERROR(reg(n, gt).status());
  const int out = activation_for(n.result());
  if (r.vec > 1 && !aligned16(out)) r.vec = 1;
  if (r.rows == 0 || r.len == 0) return ok_status();
  const std::string ignore = int_literal(n.get_int("ignore_index")), L = int_literal(r.len);
  const std::string nan = literal(r.acc_type, std::numeric_limits<double>::quiet_NaN());
  // (exp(x - lse) - onehot) * dloss: a padded column (-1e30 or -inf) gets exp(...) = 0 exactly,
  // so gradient 0; an ignored row is all zeros without reading its logits.
  const std::string grad = "(exp(v - lse) - (j == t ? (acc)1 : (acc)0)) * scale";
  std::string body = preamble(r);
  body += "  const acc dl = (acc)" + load_expr(dloss->dtype(), "dloss[0]") + ";\n";
  body += "  for (long long row = blockIdx.x; row < " + int_literal(r.rows) + "; row += gridDim.x) {\n";
  body += "    const long long base = row * " + L + ", t = (long long)target[row];\n";
  body += "    if (t == " + ignore + ") {\n";
  body += "      for (long long j = threadIdx.x; j < " + L + "; j += blockDim.x) g[base + j] = " + store_expr(gt, "(acc)0") +
          ";\n      continue;\n    }\n";
  body += online_max_sum(r);
  body += "    const acc lse = m + log(s), scale = t >= 0 && t < " + L + " ? dl : " + nan + ";\n";
  if (r.vec > 1) {
    const int64_t out_bytes = r.vec * (dtype_bits(gt) / 8);
    body += "    for (long long q = threadIdx.x; q < " + int_literal(r.len / r.vec) + "; q += blockDim.x) {\n";
    body += "      const " + vector_type(16) + " raw = reinterpret_cast<const " + vector_type(16) + "*>(x + base)[q];\n";
    body += "      const " + r.x_storage + "* e = reinterpret_cast<const " + r.x_storage + "*>(&raw);\n";
    body += "      " + vector_type(out_bytes) + " packed;\n";
    body += "      " + gst + "* o = reinterpret_cast<" + gst + "*>(&packed);\n";
    body += "#pragma unroll\n      for (int k = 0; k < " + std::to_string(r.vec) + "; ++k) {\n";
    body += "        const long long j = q * " + std::to_string(r.vec) + " + k;\n";
    body += "        const acc v = (acc)" + load_expr(r.x_type, "e[k]") + ";\n";
    body += "        o[k] = " + store_expr(gt, grad) + ";\n      }\n";
    body += "      reinterpret_cast<" + vector_type(out_bytes) + "*>(g + base)[q] = packed;\n    }\n  }\n";
  } else {
    body += "    for (long long j = threadIdx.x; j < " + L + "; j += blockDim.x) {\n";
    body += "      const acc v = (acc)" + load_expr(r.x_type, "x[base + j]") + ";\n";
    body += "      g[base + j] = " + store_expr(gt, grad) + ";\n    }\n  }\n";
  }
  const std::string name = kernel_name("cross_entropy_grad");
  add_kernel(name, "const " + r.x_storage + "* __restrict__ x, const " + r.t_storage + "* __restrict__ target, const " +
                       dst + "* __restrict__ dloss, " + gst + "* __restrict__ g", with_math(r, body));
  launch(name, r.rows, {buf(x), buf(t), buf(dloss), out});
  return ok_status();
}

}  // namespace kiln::cuda::detail
