// Lowering of a fused pointwise group that holds data-movement ops (transpose, slice, concat,
// expand, reshape-like views) to one kernel: every value is computed at a multi-index of the
// group's output space, so movement ops become index arithmetic instead of copies.
#include <cstdint>
#include <functional>
#include <set>

#include "lowerer.h"

namespace kiln::cuda::detail {
namespace {

const std::set<std::string>& movement_ops() {
  static const std::set<std::string> kOps = {"transpose", "slice",   "concat",    "expand",  "reshape",
                                             "flatten",   "squeeze", "unsqueeze", "identity"};
  return kOps;
}

/// A coordinate: `c`, or `c + e` for lane e of a vector when `lane` (c is then a multiple of
/// the vector width, so the lanes never cross a dim, a concat part or an alignment boundary).
struct Coord {
  std::string c;
  bool lane = false;
};
using Index = std::vector<Coord>;

/// A computed value: a scalar shared by every lane, or (`lane`) an array of one per lane.
struct Val {
  std::string name;
  bool lane = false;
  std::string at() const { return lane ? name + "[e]" : name; }
};

/// `idx` right-aligned against `s` (numpy broadcasting): size-1 dims read coordinate 0.
Index broadcast_index(const Index& idx, const Sizes& s) {
  Index out(s.size(), Coord{"0"});
  const size_t lead = idx.size() - s.size();
  for (size_t d = 0; d < s.size(); ++d)
    if (s[d] != 1) out[d] = idx[lead + d];
  return out;
}

}  // namespace

StatusOr<bool> Lowerer::indexed_pointwise(const Node& fused) {
  const Graph& body = fused.region(0);
  if (body.num_outputs() == 0) return false;
  const Sizes shape = sizes_of(fused.result(0));
  for (const Value* r : fused.results())
    if (sizes_of(r) != shape) return false;
  bool has_movement = false;
  int64_t largest = product(shape);
  for (const Value* v : body.inputs()) largest = std::max(largest, product(sizes_of(v)));
  for (const auto& n : body.nodes()) {
    if (n->num_results() != 1 || n->num_regions() > 0) return false;
    largest = std::max(largest, product(sizes_of(n->result())));
    if (n->op_name() == "constant") {
      if (n->attr("value") == nullptr || n->attr("value")->as_tensor().numel() != 1) return false;
    } else if (movement_ops().count(n->op_name())) {
      has_movement |= n->op_name() != "identity";
    } else if (!n->op()->has(kTraitElementwise)) {
      return false;
    }
  }
  if (!has_movement) return false;

  // 32-bit unsigned coordinates when every tensor of the group fits: 64-bit division is
  // emulated in dozens of instructions (codegen.cpp's index_code makes the same choice).
  const bool narrow = largest <= int64_t{0xffffffff};
  const std::string T = narrow ? "unsigned" : "long long";
  auto num = [&](int64_t v) { return narrow ? std::to_string(v) + "u" : int_literal(v); };

  std::string params;
  std::vector<int> args;
  std::vector<DType> types;
  for (size_t k = 0; k < fused.operands().size(); ++k) {
    KILN_ASSIGN_OR_RETURN(std::string st, storage(fused, fused.operand(static_cast<int>(k))->dtype()));
    params += "const " + st + "* __restrict__ in" + std::to_string(k) + ", ";
    args.push_back(buf(fused.operand(static_cast<int>(k))));
    types.push_back(fused.operand(static_cast<int>(k))->dtype());
  }
  for (int k = 0; k < fused.num_results(); ++k) {
    KILN_ASSIGN_OR_RETURN(std::string st, storage(fused, fused.result(k)->dtype()));
    params += st + "* __restrict__ out" + std::to_string(k) + (k + 1 < fused.num_results() ? ", " : "");
    args.push_back(activation_for(fused.result(k)));
    types.push_back(fused.result(k)->dtype());
  }
  // Nothing to compute, and zero-sized dims would break the reshape runs below.
  if (product(shape) == 0) return true;
  std::unordered_map<const Value*, int> input_of;
  for (int k = 0; k < body.num_inputs(); ++k) input_of[body.input(k)] = k;

  // The kernel body with `w` consecutive elements of the innermost output dim per thread
  // (w = 1: one), or "" when some index cannot keep a vector's lanes together.
  auto generate = [&](const int64_t w) -> StatusOr<std::string> {
    std::string code;
    bool split = false;  // the lanes of a vector would part ways: retry with w = 1
    const std::string W = std::to_string(w);
    auto lanes = [&](const std::string& stmt) { return "    #pragma unroll\n    for (int e = 0; e < " + W + "; ++e) " + stmt + "\n"; };
    // Values (and coordinates) already computed, one map per open scope (concat branches).
    std::vector<std::unordered_map<std::string, Val>> memo(1);
    int next = 0;
    auto lookup = [&](const std::string& key) -> const Val* {
      for (auto it = memo.rbegin(); it != memo.rend(); ++it)
        if (auto f = it->find(key); f != it->end()) return &f->second;
      return nullptr;
    };
    auto fresh = [&](const char* prefix) { return prefix + std::to_string(next++); };
    // A coordinate as a plain name or literal, computing `expr` once per scope.
    auto coord = [&](const std::string& expr) -> std::string {
      if (expr.find_first_of(" +-*/%()") == std::string::npos) return expr;
      if (const Val* hit = lookup("#" + expr)) return hit->name;
      const std::string name = fresh("j");
      code += "    const " + T + " " + name + " = " + expr + ";\n";
      memo.back()["#" + expr] = Val{name};
      return name;
    };
    // A new value named like `prefix`N: an array when `lane`, computed by `expr` (which may read lane e).
    auto define = [&](const std::string& rt, bool lane, const std::string& expr) {
      Val v{fresh("v"), lane};
      code += lane ? "    " + rt + " " + v.name + "[" + W + "];\n" + lanes(v.name + "[e] = " + expr + ";")
                   : "    const " + rt + " " + v.name + " = " + expr + ";\n";
      return v;
    };

    std::function<StatusOr<Val>(const Value*, const Index&)> eval;
    eval = [&](const Value* v, const Index& idx) -> StatusOr<Val> {
      std::string key = std::to_string(reinterpret_cast<uintptr_t>(v));
      for (const Coord& c : idx) key += "," + c.c + (c.lane ? "+e" : "");
      if (const Val* hit = lookup(key)) return *hit;
      const Sizes vs = sizes_of(v);
      Val result;
      if (auto in = input_of.find(v); in != input_of.end()) {
        const Sizes st = contiguous_strides(vs);
        std::string off;
        int64_t lane_stride = 0;
        bool aligned = aligned16(buf(fused.operand(in->second)));  // the lanes' first offset is a multiple of w
        for (size_t d = 0; d < vs.size(); ++d) {
          if (vs[d] == 1) continue;
          if (idx[d].lane) lane_stride += st[d];
          else aligned &= st[d] % w == 0;
          if (idx[d].c != "0") off += (off.empty() ? "" : " + ") + idx[d].c + (st[d] == 1 ? "" : " * " + num(st[d]));
        }
        if (off.empty()) off = "0";
        const DType t = v->dtype();
        KILN_ASSIGN_OR_RETURN(std::string rt, reg(fused, t));
        const std::string p = "in" + std::to_string(in->second);
        if (lane_stride == 0) {
          result = define(rt, false, load_expr(t, p + "[" + off + "]"));
        } else if (lane_stride == 1 && aligned) {
          // The lanes are w consecutive elements at a multiple of w: one vector load.
          const std::string a = fresh("a"), vt = vector_type(w * dtype_storage_bytes(t, 1));
          code += "    alignas(16) " + *storage_type(t) + " " + a + "[" + W + "];\n    *reinterpret_cast<" + vt + "*>(" + a +
                  ") = *reinterpret_cast<const " + vt + "*>(&" + p + "[" + off + "]);\n";
          result = define(rt, true, load_expr(t, a + "[e]"));
        } else {
          result = define(rt, true, load_expr(t, p + "[" + off + " + e" + (lane_stride == 1 ? "" : " * " + num(lane_stride)) + "]"));
        }
        memo.back()[key] = result;
        return result;
      }
      const Node& n = *v->producer();
      const std::string& op = n.op_name();
      const Value* x = n.num_operands() > 0 ? n.operand(0) : nullptr;
      if (op == "constant") {
        const Tensor& t = n.attr("value")->as_tensor();
        KILN_RETURN_IF_ERROR(reg(n, t.dtype()).status());
        if (is_integer(t.dtype())) return Val{int_literal(t.get_i64(0))};
        return Val{is_float(t.dtype()) ? literal(t.dtype(), t.get_f64(0)) : literal(t.dtype(), static_cast<double>(t.get_i64(0)))};
      }
      if (op == "identity") {
        KILN_ASSIGN_OR_RETURN(result, eval(x, idx));
      } else if (op == "transpose") {
        Sizes perm = n.get_ints("perm");
        if (perm.empty())
          for (size_t d = vs.size(); d-- > 0;) perm.push_back(static_cast<int64_t>(d));
        Index in(vs.size());
        for (size_t d = 0; d < perm.size(); ++d)
          in[static_cast<size_t>(norm_axis(perm[d], static_cast<int64_t>(vs.size())))] = idx[d];
        KILN_ASSIGN_OR_RETURN(result, eval(x, in));
      } else if (op == "slice") {
        const Sizes xs = sizes_of(x);
        const int64_t rank = static_cast<int64_t>(xs.size());
        Sizes axes = n.get_ints("axes"), starts = n.get_ints("starts"), ends = n.get_ints("ends"), steps = n.get_ints("steps");
        if (!n.has_attr("axes"))
          for (size_t i = 0; i < starts.size(); ++i) axes.push_back(static_cast<int64_t>(i));
        if (!n.has_attr("steps")) steps.assign(starts.size(), 1);
        Index in = idx;
        for (size_t i = 0; i < axes.size(); ++i) {
          const size_t a = static_cast<size_t>(norm_axis(axes[i], rank));
          const SliceAxis s = clamp_slice(xs[a], starts[i], ends[i], steps[i]);
          if (vs[a] == 1) {
            in[a] = Coord{num(s.start)};
            continue;
          }
          split |= idx[a].lane && (s.step != 1 || s.start % w != 0);
          const std::string& c = idx[a].c;
          const std::string scaled = s.step == 1 || s.step == -1 ? c : c + " * " + num(s.step < 0 ? -s.step : s.step);
          if (s.step > 0)
            in[a].c = coord(s.start == 0 ? scaled : "(" + num(s.start) + " + " + scaled + ")");
          else
            in[a].c = coord("(" + num(s.start) + " - " + scaled + ")");
        }
        KILN_ASSIGN_OR_RETURN(result, eval(x, in));
      } else if (op == "expand") {
        KILN_ASSIGN_OR_RETURN(result, eval(x, broadcast_index(idx, sizes_of(x))));
      } else if (op == "reshape" || op == "flatten" || op == "squeeze" || op == "unsqueeze") {
        // Runs of dims with equal products map onto each other (a split, a merge, or one dim
        // unchanged): the result coordinates of a run are linearized and split into the input's.
        // Size-1 dims take no part; a coordinate of one is always 0. Lanes stay together when
        // they run along the innermost dim of both sides of a run and both are multiples of w.
        const Sizes xs = sizes_of(x);
        Index in(xs.size(), Coord{"0"});
        std::vector<size_t> xd, vd;
        for (size_t d = 0; d < xs.size(); ++d)
          if (xs[d] != 1) xd.push_back(d);
        for (size_t d = 0; d < vs.size(); ++d)
          if (vs[d] != 1) vd.push_back(d);
        for (size_t a = 0, b = 0; a < xd.size() && b < vd.size();) {
          const size_t a0 = a, b0 = b;
          int64_t pa = xs[xd[a++]], pb = vs[vd[b++]];
          while (pa != pb) {
            if (pa < pb)
              pa *= xs[xd[a++]];
            else
              pb *= vs[vd[b++]];
          }
          if (a - a0 == 1 && b - b0 == 1) {
            in[xd[a0]] = idx[vd[b0]];
            continue;
          }
          for (size_t k = b0; k + 1 < b; ++k) split |= idx[vd[k]].lane;
          const bool lane = idx[vd[b - 1]].lane;
          split |= lane && (vs[vd[b - 1]] % w != 0 || xs[xd[a - 1]] % w != 0);
          std::string lin;
          int64_t inner = 1;
          for (size_t k = b; k-- > b0;) {
            lin = idx[vd[k]].c + (inner == 1 ? "" : " * " + num(inner)) + (lin.empty() ? "" : " + " + lin);
            inner *= vs[vd[k]];
          }
          lin = b - b0 == 1 ? lin : coord("(" + lin + ")");
          inner = 1;
          for (size_t k = a; k-- > a0;) {
            std::string c = inner == 1 ? lin : "(" + lin + " / " + num(inner) + ")";
            if (k != a0) c = "(" + c + " % " + num(xs[xd[k]]) + ")";
            in[xd[k]] = Coord{coord(c), lane && k + 1 == a};
            inner *= xs[xd[k]];
          }
        }
        KILN_ASSIGN_OR_RETURN(result, eval(x, in));
      } else if (op == "concat") {
        // Only the branch whose range holds the coordinate computes its operand.
        const size_t a = static_cast<size_t>(norm_axis(n.get_int("axis"), static_cast<int64_t>(vs.size())));
        KILN_ASSIGN_OR_RETURN(std::string rt, reg(n, v->dtype()));
        bool lane = false;
        for (const Coord& c : idx) lane |= c.lane;
        result = Val{fresh("v"), lane};
        code += "    " + rt + " " + result.name + (lane ? "[" + W + "]" : "") + ";\n";
        std::vector<std::pair<const Value*, int64_t>> parts;  // operand, first coordinate
        int64_t at = 0;
        for (const Value* p : n.operands()) {
          const int64_t len = sizes_of(p)[a];
          if (len > 0) parts.emplace_back(p, at);
          split |= idx[a].lane && at % w != 0;
          at += len;
        }
        for (size_t k = 0; k < parts.size(); ++k) {
          const bool last = k + 1 == parts.size();
          const std::string cond = last ? "" : "if (" + idx[a].c + " < " + num(parts[k].second + sizes_of(parts[k].first)[a]) + ") ";
          code += std::string(k == 0 ? "    " : "    } else ") + cond + "{\n";
          memo.emplace_back();
          Index in = idx;
          if (parts[k].second != 0) in[a].c = coord("(" + idx[a].c + " - " + num(parts[k].second) + ")");
          StatusOr<Val> part = eval(parts[k].first, in);
          memo.pop_back();
          KILN_RETURN_IF_ERROR(part.status());
          code += lane ? lanes(result.name + "[e] = " + part->at() + ";") : "    " + result.name + " = " + part->name + ";\n";
        }
        code += "    }\n";
      } else {
        std::vector<std::string> a;
        bool lane = false;
        for (const Value* p : n.operands()) {
          KILN_RETURN_IF_ERROR(reg(n, p->dtype()).status());
          KILN_ASSIGN_OR_RETURN(Val e, eval(p, broadcast_index(idx, sizes_of(p))));
          a.push_back(e.at());
          lane |= e.lane;
        }
        KILN_ASSIGN_OR_RETURN(std::string e, op_expr(n, a));
        KILN_ASSIGN_OR_RETURN(std::string rt, reg(n, v->dtype()));
        result = define(rt, lane, round_expr(v->dtype(), e));
      }
      memo.back()[key] = result;
      return result;
    };

    // The output index space: coordinates of the flat index i (a vector's first element), row-major.
    Index idx(shape.size(), Coord{"0"});
    code += "    " + T + " r_ = (" + T + ")i; (void)r_;\n";
    for (size_t d = shape.size(); d-- > 0;) {
      if (shape[d] == 1) continue;
      idx[d] = Coord{"c" + std::to_string(d), w > 1 && d + 1 == shape.size()};
      code += "    const " + T + " c" + std::to_string(d) + " = " +
              (d == 0 ? "r_;\n" : "r_ % " + num(shape[d]) + "; r_ /= " + num(shape[d]) + ";\n");
    }
    for (int k = 0; k < fused.num_results(); ++k) {
      KILN_ASSIGN_OR_RETURN(Val r, eval(body.output(k), idx));
      const DType t = fused.result(k)->dtype();
      const std::string o = "out" + std::to_string(k);
      if (w == 1) {
        code += "    " + o + "[i] = " + store_expr(t, r.at()) + ";\n";
        continue;
      }
      const std::string s = fresh("s"), vt = vector_type(w * dtype_storage_bytes(t, 1));
      code += "    alignas(16) " + *storage_type(t) + " " + s + "[" + W + "];\n" + lanes(s + "[e] = " + store_expr(t, r.at()) + ";") +
              "    *reinterpret_cast<" + vt + "*>(&" + o + "[i]) = *reinterpret_cast<const " + vt + "*>(" + s + ");\n";
    }
    return split ? std::string() : code;
  };

  // w consecutive outputs per thread: 16-byte stores of the widest dtype, coalesced across a warp.
  int64_t w = vector_width(types);
  if (w && shape.back() % w == 0) {
    KILN_ASSIGN_OR_RETURN(std::string code, generate(w));
    if (!code.empty()) {
      launch_vectors(kernel_name("fused"), params, product(shape), w, code, args);
      return true;
    }
  }
  KILN_ASSIGN_OR_RETURN(std::string code, generate(1));
  launch_elementwise(kernel_name("fused"), params, product(shape), code, args);
  return true;
}

}  // namespace kiln::cuda::detail
