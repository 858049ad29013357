// Reading .kiln artifacts: header, section table and checksums, meta, and the plan parser
// with its reference checks (docs/artifact.md). No CUDA here: `kiln inspect` uses it too.
#include "kiln/artifact_reader.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <tuple>
#include <utility>

#include "kiln/artifact_format.h"

namespace kiln::artifact {

int dtype_bits(std::string_view name) {
  static const std::map<std::string_view, int> bits = {
      {"f64", 64}, {"f32", 32}, {"f16", 16}, {"bf16", 16}, {"f8e4m3fn", 8}, {"f8e5m2", 8}, {"i64", 64},
      {"i32", 32}, {"i16", 16}, {"i8", 8},   {"u8", 8},    {"i4", 4},     {"bool", 8}};
  auto it = bits.find(name);
  return it == bits.end() ? 0 : it->second;
}

namespace {

using Attrs = std::map<std::string, std::string, std::less<>>;

uint64_t get_le(const std::string& s, uint64_t at, int size) {
  uint64_t v = 0;
  for (int i = size - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(s[at + static_cast<uint64_t>(i)]);
  return v;
}

template <typename T>
bool parse_num(std::string_view s, T* out) {
  if (s.empty()) return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size();
}

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  for (size_t start = 0;;) {
    const size_t end = s.find(sep, start);
    out.push_back(s.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start));
    if (end == std::string_view::npos) return out;
    start = end + 1;
  }
}

/// `offset + bytes <= limit` without overflow.
bool fits(uint64_t offset, uint64_t bytes, uint64_t limit) { return bytes <= limit && offset <= limit - bytes; }

/// The plan parser: one line at a time, each line checked against what came before.
class PlanParser {
 public:
  PlanParser(Plan* plan, std::string* error) : p_(*plan), error_(error) {}

  bool parse(std::string_view text) {
    for (std::string_view rest = text; !rest.empty();) {
      const size_t nl = rest.find('\n');
      std::string_view line = rest.substr(0, nl);
      rest = nl == std::string_view::npos ? std::string_view() : rest.substr(nl + 1);
      ++line_;
      if (const size_t hash = line.find('#'); hash != std::string_view::npos) line = line.substr(0, hash);
      if (line.ends_with('\r')) line.remove_suffix(1);
      std::vector<std::string_view> toks;
      for (std::string_view t : split(line, ' '))
        if (!t.empty()) toks.push_back(t);
      if (!toks.empty() && !parse_line(toks)) return false;
    }
    if (stage_ < 0) return fail("empty plan: expected 'kiln-plan 1'");
    if (stage_ < 2) return fail(std::string("missing '") + (stage_ < 1 ? "arena" : "workspace") + "' line");
    return true;
  }

 private:
  bool fail(const std::string& msg) {
    if (error_) *error_ = "plan:" + std::to_string(line_) + ": " + msg;
    return false;
  }

  /// Lines must come in the documented order; each kind has its rank.
  bool parse_line(const std::vector<std::string_view>& toks) {
    static const std::vector<std::string_view> order = {"kiln-plan", "arena",  "workspace", "mesh",  "buffer",
                                                        "input",     "output", "variable",  "kernel", "step"};
    const auto it = std::find(order.begin(), order.end(), toks[0]);
    if (it == order.end()) return fail("unknown line '" + std::string(toks[0]) + "'");
    const int rank = static_cast<int>(it - order.begin());
    if (stage_ < 0 && rank != 0) return fail("expected 'kiln-plan 1' first");
    if (rank < stage_ || (rank == stage_ && rank <= 3))
      return fail("'" + std::string(toks[0]) + "' out of order (lines go: kiln-plan, arena, workspace, [mesh], buffer, "
                  "input, output, [variable], kernel, step)");
    if (rank > 1 && stage_ < 1) return fail("missing 'arena' line");
    if (rank > 2 && stage_ < 2) return fail("missing 'workspace' line");
    stage_ = rank;
    switch (rank) {
      case 0:
        if (toks.size() != 2 || toks[1] != "1")
          return fail("plan format version '" + (toks.size() > 1 ? std::string(toks[1]) : "") + "'; this runtime reads 1");
        return true;
      case 1:
      case 2: {
        Attrs a;
        if (!attrs(toks, 1, &a, {"bytes"}, {})) return false;
        return num(a, "bytes", rank == 1 ? &p_.arena_bytes : &p_.workspace_bytes);
      }
      case 3: return mesh(toks);
      case 4: return buffer(toks);
      case 5:
      case 6: return io(toks, rank == 5);
      case 7: return variable(toks);
      case 8:
        if (toks.size() != 2) return fail("expected 'kernel NAME'");
        if (std::find(p_.kernels.begin(), p_.kernels.end(), toks[1]) != p_.kernels.end())
          return fail("kernel '" + std::string(toks[1]) + "' declared twice");
        p_.kernels.emplace_back(toks[1]);
        return true;
      default: return step(toks);
    }
  }

  /// Reads `key=value` tokens from `from` on; `required` must be there, and every key must be
  /// in `required` or `optional`.
  bool attrs(const std::vector<std::string_view>& toks, size_t from, Attrs* out,
             std::initializer_list<std::string_view> required, std::initializer_list<std::string_view> optional) {
    for (size_t i = from; i < toks.size(); ++i) {
      const size_t eq = toks[i].find('=');
      if (eq == std::string_view::npos || eq == 0) return fail("expected key=value, got '" + std::string(toks[i]) + "'");
      const std::string_view key = toks[i].substr(0, eq);
      if (std::find(required.begin(), required.end(), key) == required.end() &&
          std::find(optional.begin(), optional.end(), key) == optional.end())
        return fail("unknown attribute '" + std::string(key) + "' on '" + std::string(toks[0]) +
                    (toks[0] == "step" ? " " + std::string(toks[1]) : "") + "'");
      if (!out->emplace(std::string(key), std::string(toks[i].substr(eq + 1))).second)
        return fail("attribute '" + std::string(key) + "' given twice");
    }
    const std::string what = std::string(toks[0]) + (toks[0] == "step" ? " " + std::string(toks[1]) : "");
    for (std::string_view r : required)
      if (!out->count(r)) return fail("'" + what + "' needs " + std::string(r) + "=");
    return true;
  }

  template <typename T>
  bool num(const Attrs& a, std::string_view key, T* out) {
    const std::string& v = a.find(key)->second;
    if (!parse_num(v, out)) return fail(std::string(key) + "='" + v + "' is not a valid number");
    return true;
  }

  /// "bID" naming a declared buffer.
  bool buffer_ref(std::string_view text, int* id) {
    if (text.size() < 2 || text[0] != 'b' || !parse_num(text.substr(1), id) || *id < 0)
      return fail("expected a buffer reference bID, got '" + std::string(text) + "'");
    if (static_cast<size_t>(*id) >= p_.buffers.size())
      return fail("buffer " + std::to_string(*id) + " is not declared");
    return true;
  }

  bool buffer(const std::vector<std::string_view>& toks) {
    PlanBuffer b;
    if (toks.size() < 2 || !parse_num(toks[1], &b.id)) return fail("expected 'buffer ID ...'");
    const std::string what = "buffer " + std::string(toks[1]);
    if (b.id != static_cast<int>(p_.buffers.size()))
      return fail(what + ": expected id " + std::to_string(p_.buffers.size()) + " (ids are 0..count-1 in order)");
    Attrs a;
    if (!attrs(toks, 2, &a, {"kind", "dtype", "shape", "bytes", "offset"}, {"base", "name", "rank_axis", "rank_stride"}))
      return false;
    static const std::map<std::string, PlanBuffer::Kind, std::less<>> kinds = {
        {"input", PlanBuffer::Kind::kInput},           {"output", PlanBuffer::Kind::kOutput},
        {"activation", PlanBuffer::Kind::kActivation}, {"weight", PlanBuffer::Kind::kWeight},
        {"alias", PlanBuffer::Kind::kAlias}};
    const auto kind = kinds.find(a["kind"]);
    if (kind == kinds.end()) return fail(what + ": unknown kind '" + a["kind"] + "'");
    b.kind = kind->second;
    b.dtype = a["dtype"];
    const int bits = dtype_bits(b.dtype);
    if (bits == 0) return fail(what + ": unknown dtype '" + b.dtype + "'");
    if (a["shape"] != "scalar") {
      for (std::string_view d : split(a["shape"], 'x')) {
        int64_t v = 0;
        if (!parse_num(d, &v) || v < 0) return fail(what + ": bad shape '" + a["shape"] + "'");
        b.shape.push_back(v);
      }
    }
    if (!num(a, "bytes", &b.bytes) || !num(a, "offset", &b.offset)) return false;
    uint64_t bits_total = static_cast<uint64_t>(bits);
    for (int64_t d : b.shape)
      if (__builtin_mul_overflow(bits_total, static_cast<uint64_t>(d), &bits_total))
        return fail(what + ": shape '" + a["shape"] + "' is too large");
    if (b.bytes < (bits_total + 7) / 8)
      return fail(what + ": " + std::to_string(b.bytes) + " bytes cannot hold " + b.dtype + " of shape " + a["shape"]);
    if (a.count("name")) b.name = a["name"];
    if (b.kind == PlanBuffer::Kind::kAlias) {
      if (!a.count("base")) return fail(what + ": an alias needs base=ID");
      if (!parse_num(a["base"], &b.base) || b.base < 0 || b.base >= b.id)
        return fail(what + ": base '" + a["base"] + "' is not a buffer declared before it");
      const PlanBuffer& base = p_.buffers[static_cast<size_t>(b.base)];
      if (!fits(b.offset, b.bytes, base.bytes))
        return fail(what + ": bytes [" + std::to_string(b.offset) + ", +" + std::to_string(b.bytes) +
                    ") outside its base buffer " + std::to_string(b.base) + " of " + std::to_string(base.bytes) + " bytes");
    } else if (a.count("base")) {
      return fail(what + ": base= is only for kind=alias");
    }
    if (!rank_dependent(a, what, &b)) return false;
    const bool in_arena = b.kind == PlanBuffer::Kind::kInput || b.kind == PlanBuffer::Kind::kOutput ||
                          b.kind == PlanBuffer::Kind::kActivation;
    if (in_arena && !fits(b.offset, b.bytes, p_.arena_bytes))
      return fail(what + ": bytes [" + std::to_string(b.offset) + ", +" + std::to_string(b.bytes) +
                  ") outside the arena of " + std::to_string(p_.arena_bytes) + " bytes");
    p_.buffers.push_back(std::move(b));
    return true;
  }

  /// The mesh axis called `name`, or null.
  const MeshAxis* axis(std::string_view name) const {
    for (const MeshAxis& a : p_.mesh)
      if (a.name == name) return &a;
    return nullptr;
  }

  /// `mesh AXIS=SIZE ...`: names are identifiers, each once; sizes >= 1.
  bool mesh(const std::vector<std::string_view>& toks) {
    if (toks.size() < 2) return fail("expected 'mesh AXIS=SIZE ...'");
    for (size_t i = 1; i < toks.size(); ++i) {
      const size_t eq = toks[i].find('=');
      MeshAxis ax;
      ax.name = std::string(toks[i].substr(0, eq == std::string_view::npos ? toks[i].size() : eq));
      const bool ident = !ax.name.empty() && !std::isdigit(static_cast<unsigned char>(ax.name[0])) &&
                         std::all_of(ax.name.begin(), ax.name.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; });
      if (eq == std::string_view::npos || !ident || !parse_num(toks[i].substr(eq + 1), &ax.size) || ax.size < 1)
        return fail("mesh: expected AXIS=SIZE with an identifier and a size >= 1, got '" + std::string(toks[i]) + "'");
      if (axis(ax.name)) return fail("mesh: axis '" + ax.name + "' is named twice");
      p_.mesh.push_back(std::move(ax));
    }
    int64_t ranks = 1;
    for (const MeshAxis& ax : p_.mesh)
      if (__builtin_mul_overflow(ranks, ax.size, &ranks) || ranks > (int64_t{1} << 24))
        return fail("mesh: " + mesh_text(p_) + " has too many ranks");
    return true;
  }

  /// A buffer's rank_axis= and rank_stride=: this rank's bytes start rank_stride * coord further.
  bool rank_dependent(Attrs& a, const std::string& what, PlanBuffer* b) {
    if (!a.count("rank_axis") && !a.count("rank_stride")) return true;
    if (!a.count("rank_axis") || !a.count("rank_stride")) return fail(what + ": rank_axis= and rank_stride= go together");
    if (b->kind != PlanBuffer::Kind::kWeight && b->kind != PlanBuffer::Kind::kAlias)
      return fail(what + ": rank_axis= is only for kind=weight or kind=alias");
    const MeshAxis* ax = axis(a["rank_axis"]);
    if (!ax)
      return fail(what + ": rank_axis '" + a["rank_axis"] + "' is not an axis of the plan's mesh" +
                  (p_.mesh.empty() ? " (it has no 'mesh' line)" : " (" + mesh_text(p_) + ")"));
    if (!num(a, "rank_stride", &b->rank_stride)) return false;
    b->rank_axis = ax->name;
    uint64_t last = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(ax->size - 1), b->rank_stride, &last) ||
        __builtin_add_overflow(last, b->offset, &last))
      return fail(what + ": rank_stride " + std::to_string(b->rank_stride) + " is too large");
    if (b->kind == PlanBuffer::Kind::kAlias) {
      const PlanBuffer& base = p_.buffers[static_cast<size_t>(b->base)];
      if (!fits(last, b->bytes, base.bytes))
        return fail(what + ": the last rank's bytes [" + std::to_string(last) + ", +" + std::to_string(b->bytes) +
                    ") lie outside its base buffer " + std::to_string(b->base) + " of " + std::to_string(base.bytes) +
                    " bytes");
    }
    return true;
  }

  /// "R", "S(1)", "P(sum)" per mesh axis, comma-separated.
  bool placement(std::string_view text, const std::string& what, int rank, std::vector<PlanPlacement>* out) {
    if (p_.mesh.empty()) return fail(what + ": placement= needs a 'mesh' line");
    for (std::string_view t : split(text, ',')) {
      PlanPlacement pl;
      if (t == "R") {
        pl.kind = PlanPlacement::Kind::kReplicate;
      } else if (t.size() > 3 && t.starts_with("S(") && t.ends_with(")") && parse_num(t.substr(2, t.size() - 3), &pl.dim)) {
        pl.kind = PlanPlacement::Kind::kShard;
        if (pl.dim < 0 || pl.dim >= rank)
          return fail(what + ": placement " + std::string(t) + " names a dim outside rank " + std::to_string(rank));
      } else if (t == "P(sum)" || t == "P(max)") {
        pl.kind = PlanPlacement::Kind::kPartial;
        pl.reduce = std::string(t.substr(2, 3));
      } else {
        return fail(what + ": expected placement R, S(dim) or P(sum|max), got '" + std::string(t) + "'");
      }
      out->push_back(std::move(pl));
    }
    if (out->size() != p_.mesh.size())
      return fail(what + ": placement '" + std::string(text) + "' has " + std::to_string(out->size()) +
                  " entries for a mesh of " + std::to_string(p_.mesh.size()) + " axes");
    return true;
  }

  bool io(const std::vector<std::string_view>& toks, bool input) {
    const std::string what = input ? "input" : "output";
    if (toks.size() != 3 && toks.size() != 4) return fail("expected '" + what + " NAME buffer=ID [placement=...]'");
    Attrs a;
    if (!attrs(toks, 2, &a, {"buffer"}, {"placement"})) return false;
    int id = -1;
    if (!parse_num(a["buffer"], &id) || id < 0 || static_cast<size_t>(id) >= p_.buffers.size())
      return fail(what + " '" + std::string(toks[1]) + "': buffer '" + a["buffer"] + "' is not declared");
    if (input && p_.buffers[static_cast<size_t>(id)].kind != PlanBuffer::Kind::kInput)
      return fail("input '" + std::string(toks[1]) + "': buffer " + a["buffer"] + " is not of kind input");
    auto& list = input ? p_.inputs : p_.outputs;
    for (const auto& [name, b] : list)
      if (name == toks[1]) return fail(what + " '" + name + "' declared twice");
    std::vector<PlanPlacement> pl;
    if (a.count("placement") &&
        !placement(a["placement"], what + " '" + std::string(toks[1]) + "'",
                   static_cast<int>(p_.buffers[static_cast<size_t>(id)].shape.size()), &pl))
      return false;
    list.emplace_back(std::string(toks[1]), id);
    (input ? p_.input_placements : p_.output_placements).push_back(std::move(pl));
    return true;
  }

  /// `variable NAME buffer=ID [copy_of=OTHER]`: a weight buffer the plan's copy steps write
  /// (training state), which the C API reads and writes by name; copy_of names the variable
  /// declared before it that it is a low-precision copy of.
  bool variable(const std::vector<std::string_view>& toks) {
    if (toks.size() != 3 && toks.size() != 4) return fail("expected 'variable NAME buffer=ID [copy_of=NAME]'");
    Attrs a;
    if (!attrs(toks, 2, &a, {"buffer"}, {"copy_of"})) return false;
    int id = -1;
    if (!parse_num(a["buffer"], &id) || id < 0 || static_cast<size_t>(id) >= p_.buffers.size())
      return fail("variable '" + std::string(toks[1]) + "': buffer '" + a["buffer"] + "' is not declared");
    if (p_.buffers[static_cast<size_t>(id)].kind != PlanBuffer::Kind::kWeight)
      return fail("variable '" + std::string(toks[1]) + "': buffer " + a["buffer"] + " is not of kind weight");
    for (const auto& [name, b] : p_.variables)
      if (name == toks[1]) return fail("variable '" + name + "' declared twice");
    if (a.count("copy_of")) {
      const std::string& master = a["copy_of"];
      auto m = std::find_if(p_.variables.begin(), p_.variables.end(), [&](const auto& v) { return v.first == master; });
      if (m == p_.variables.end() || p_.variable_copies.count(master))
        return fail("variable '" + std::string(toks[1]) + "': copy_of '" + master +
                    "' is not a variable declared before it (and not a copy itself)");
      if (p_.buffers[static_cast<size_t>(m->second)].shape != p_.buffers[static_cast<size_t>(id)].shape)
        return fail("variable '" + std::string(toks[1]) + "': its shape is not that of '" + master + "', its copy_of");
      p_.variable_copies[std::string(toks[1])] = master;
    }
    p_.variables.emplace_back(std::string(toks[1]), id);
    return true;
  }

  bool dims3(const Attrs& a, std::string_view key, uint32_t* out) {
    const std::vector<std::string_view> parts = split(a.find(key)->second, ',');
    bool ok = parts.size() == 3;
    for (size_t i = 0; ok && i < 3; ++i) ok = parse_num(parts[i], &out[i]) && out[i] > 0;
    if (!ok) return fail(std::string(key) + "='" + a.find(key)->second + "' is not three positive integers X,Y,Z");
    return true;
  }

  bool step(const std::vector<std::string_view>& toks) {
    PlanStep s;
    s.line = line_;
    if (toks.size() < 2) return fail("expected 'step KIND ...'");
    if (toks[1] == "launch") {
      s.kind = PlanStep::Kind::kLaunch;
      Attrs a;
      if (!attrs(toks, 2, &a, {"kernel", "grid", "block"}, {"smem", "args"})) return false;
      s.kernel = a["kernel"];
      if (std::find(p_.kernels.begin(), p_.kernels.end(), s.kernel) == p_.kernels.end())
        return fail("kernel '" + s.kernel + "' is not declared");
      if (!dims3(a, "grid", s.grid) || !dims3(a, "block", s.block)) return false;
      if (a.count("smem") && !num(a, "smem", &s.smem)) return false;
      if (a.count("args") && !a["args"].empty()) {
        for (std::string_view t : split(a["args"], ',')) {
          LaunchArg arg;
          const bool ok = t.size() >= 2;
          if (ok && t[0] == 'b') {
            if (!buffer_ref(t, &arg.buffer)) return false;
          } else if (ok && t[0] == 'i' && parse_num(t.substr(1), &arg.i64)) {
            arg.kind = LaunchArg::Kind::kInt64;
          } else if (ok && t[0] == 'f' && parse_num(t.substr(1), &arg.f32)) {
            arg.kind = LaunchArg::Kind::kFloat32;
          } else {
            return fail("bad launch argument '" + std::string(t) + "' (expected bID, iN or fN)");
          }
          s.args.push_back(arg);
        }
      }
    } else if (toks[1] == "gemm") {
      s.kind = PlanStep::Kind::kGemm;
      if (!gemm(toks, &s.attrs)) return false;
    } else if (toks[1] == "conv") {
      s.kind = PlanStep::Kind::kConv;
      if (!conv(toks, &s.attrs)) return false;
    } else if (toks[1] == "collective") {
      s.kind = PlanStep::Kind::kCollective;
      if (!collective(toks, &s.attrs)) return false;
    } else if (toks[1] == "copy" || toks[1] == "memset") {
      const bool copy = toks[1] == "copy";
      s.kind = copy ? PlanStep::Kind::kCopy : PlanStep::Kind::kMemset;
      Attrs a;
      if (copy ? !attrs(toks, 2, &a, {"src", "dst", "bytes"}, {}) : !attrs(toks, 2, &a, {"dst", "bytes"}, {}))
        return false;
      uint64_t bytes = 0;
      if (!num(a, "bytes", &bytes)) return false;
      for (const char* key : {"src", "dst"}) {
        if (!a.count(key)) continue;
        int id = -1;
        if (!buffer_ref(a[key], &id)) return false;
        const uint64_t have = p_.buffers[static_cast<size_t>(id)].bytes;
        if (bytes > have)
          return fail(std::string(toks[1]) + " of " + std::to_string(bytes) + " bytes exceeds buffer " +
                      std::to_string(id) + " (" + std::to_string(have) + " bytes)");
      }
      s.attrs.insert(a.begin(), a.end());
    } else {
      return fail("unknown step '" + std::string(toks[1]) + "'");
    }
    p_.steps.push_back(std::move(s));
    return true;
  }

  /// Checks a collective step: the op and its attributes, the mesh axis or peer, the dtype (a
  /// reduction needs one NCCL can add), and that x and y hold what the op reads and writes.
  bool collective(const std::vector<std::string_view>& toks, std::map<std::string, std::string>* out) {
    Attrs a;
    if (!attrs(toks, 2, &a, {"op", "count", "dtype"}, {"axis", "x", "y", "reduce", "root", "peer", "tag"})) return false;
    const std::string op = a["op"];
    if (std::find(std::begin(kCollectiveOps), std::end(kCollectiveOps), op) == std::end(kCollectiveOps))
      return fail("collective: unknown op '" + op + "' (all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, "
                  "send or recv)");
    const std::string what = "collective " + op;
    if (p_.mesh.empty()) return fail(what + ": a collective step needs a 'mesh' line");
    const bool p2p = op == "send" || op == "recv";
    const bool reduces = op == "all_reduce" || op == "reduce_scatter";
    // Each op's attributes, beyond op, count and dtype.
    std::vector<std::string> need = p2p ? std::vector<std::string>{"peer", op == "send" ? "x" : "y"}
                                        : std::vector<std::string>{"axis", "x", "y"};
    if (reduces) need.push_back("reduce");
    if (op == "broadcast") need.push_back("root");
    std::vector<std::string> allowed = need;
    if (p2p) allowed.insert(allowed.end(), {"tag", "axis"});
    for (const std::string& k : need)
      if (!a.count(k)) return fail(what + " needs " + k + "=");
    for (const auto& [k, v] : a)
      if (k != "op" && k != "count" && k != "dtype" && std::find(allowed.begin(), allowed.end(), k) == allowed.end())
        return fail(what + ": attribute '" + k + "' does not apply");
    uint64_t count = 0;
    if (!num(a, "count", &count)) return false;
    const int bits = dtype_bits(a["dtype"]);
    if (bits == 0) return fail(what + ": unknown dtype '" + a["dtype"] + "'");
    static const std::set<std::string, std::less<>> kReducible = {"f64", "f32", "f16", "bf16", "f8e4m3fn",
                                                                  "f8e5m2", "i64", "i32", "i8", "u8"};
    if (reduces && !kReducible.count(a["dtype"]))
      return fail(what + ": NCCL cannot reduce " + a["dtype"] + " (f64, f32, f16, bf16, f8e4m3fn, f8e5m2, i64, i32, "
                  "i8 or u8)");
    if (reduces && a["reduce"] != "sum" && a["reduce"] != "max")
      return fail(what + ": reduce='" + a["reduce"] + "' is not sum or max");
    int64_t group = 1;
    if (p2p) {
      int64_t peer = -1;
      if (!num(a, "peer", &peer)) return false;
      if (a.count("axis")) {  // peer is a position along the axis, the other coordinates this rank's
        const MeshAxis* ax = axis(a["axis"]);
        if (!ax) return fail(what + ": the plan's mesh " + mesh_text(p_) + " has no axis '" + a["axis"] + "'");
        if (peer < 0 || peer >= ax->size)
          return fail(what + ": peer " + a["peer"] + " is not a position along mesh axis '" + a["axis"] + "' of " +
                      std::to_string(ax->size));
      } else if (peer < 0 || peer >= mesh_ranks(p_)) {
        return fail(what + ": peer " + a["peer"] + " is not a rank of mesh " + mesh_text(p_));
      }
      int64_t tag = 0;
      if (a.count("tag") && !num(a, "tag", &tag)) return false;
    } else {
      const MeshAxis* ax = axis(a["axis"]);
      if (!ax) return fail(what + ": the plan's mesh " + mesh_text(p_) + " has no axis '" + a["axis"] + "'");
      group = ax->size;
      if (op == "broadcast") {
        int64_t root = -1;
        if (!num(a, "root", &root)) return false;
        if (root < 0 || root >= group)
          return fail(what + ": root " + a["root"] + " is outside a group of " + std::to_string(group));
      }
    }
    // Elements each buffer holds, in units of count: the gathered or scattered side holds the group's.
    uint64_t bytes = 0;
    if (__builtin_mul_overflow(count, static_cast<uint64_t>(bits), &bytes) || bytes % 8)
      return fail(what + ": count " + a["count"] + " of " + a["dtype"] + " is not a whole number of bytes");
    bytes /= 8;
    const int64_t x_times = op == "reduce_scatter" || op == "all_to_all" ? group : 1;
    const int64_t y_times = op == "all_gather" || op == "all_to_all" ? group : 1;
    for (const auto& [key, times] : {std::pair{"x", x_times}, std::pair{"y", y_times}}) {
      if (!a.count(key)) continue;
      int id = -1;
      if (!buffer_ref(a[key], &id)) return false;
      uint64_t need_bytes = 0;
      const uint64_t have = p_.buffers[static_cast<size_t>(id)].bytes;
      if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(times), &need_bytes) || need_bytes > have)
        return fail(what + ": " + key + " (buffer " + std::to_string(id) + ", " + std::to_string(have) +
                    " bytes) cannot hold " + std::to_string(times) + " x " + a["count"] + " " + a["dtype"]);
    }
    out->insert(a.begin(), a.end());
    return true;
  }

  /// Checks a gemm's attributes, and that each matrix it touches lies within its buffer.
  bool gemm(const std::vector<std::string_view>& toks, std::map<std::string, std::string>* out) {
    Attrs a;
    if (!attrs(toks, 2, &a,
               {"a", "b", "d", "m", "n", "k", "batch", "trans_a", "trans_b", "lda", "ldb", "ldd", "stride_a",
                "stride_b", "stride_d", "dtype", "compute", "alpha", "beta", "epilogue"},
               {"c", "bias", "ldc", "stride_c", "a_dtype", "b_dtype", "a_scale", "b_scale", "amax_d", "fast_accum",
                "algo"}))
      return false;
    if (a.count("algo") && (a["algo"].size() != kGemmAlgoHexDigits ||
                            a["algo"].find_first_not_of("0123456789abcdef") != std::string::npos))
      return fail("gemm: algo='" + a["algo"] + "' is not " + std::to_string(kGemmAlgoHexDigits) +
                  " lowercase hex digits (a tuned cublasLtMatmulAlgo_t)");
    auto one_of = [&](std::string_view key, std::initializer_list<std::string_view> allowed) {
      if (std::find(allowed.begin(), allowed.end(), a[std::string(key)]) != allowed.end()) return true;
      return fail("gemm: " + std::string(key) + "='" + a[std::string(key)] + "' is not allowed");
    };
    if (!one_of("dtype", {"f32", "f16", "bf16"}) || !one_of("compute", {"f32", "tf32"}) ||
        !one_of("trans_a", {"0", "1"}) || !one_of("trans_b", {"0", "1"}) ||
        !one_of("epilogue", {"none", "relu", "gelu", "bias", "bias_relu", "bias_gelu", "bgrad_a", "bgrad_b"}))
      return false;
    if (!fp8_gemm(a)) return false;
    float alpha = 0, beta = 0;
    if (!num(a, "alpha", &alpha) || !num(a, "beta", &beta)) return false;
    // bgrad_a/bgrad_b write a bias gradient into bias=: op(A)'s or op(B)'s sum over k.
    const bool has_bias = a["epilogue"].starts_with("bias") || a["epilogue"].starts_with("bgrad");
    if (has_bias != (a.count("bias") > 0))
      return fail("gemm: bias= must be given exactly when the epilogue adds a bias or writes its gradient");
    if (a.count("c") && !a.count("ldc")) return fail("gemm: c= needs ldc=");
    uint64_t m = 0, n = 0, k = 0, batch = 0;
    if (!num(a, "m", &m) || !num(a, "n", &n) || !num(a, "k", &k) || !num(a, "batch", &batch)) return false;
    // {operand, rows, cols}, row-major with leading dimension ld and batch stride.
    struct Operand { const char* name; uint64_t rows, cols; const char* ld; const char* stride; };
    const bool ta = a["trans_a"] == "1", tb = a["trans_b"] == "1";
    const Operand ops[] = {{"a", ta ? k : m, ta ? m : k, "lda", "stride_a"},
                           {"b", tb ? n : k, tb ? k : n, "ldb", "stride_b"},
                           {"d", m, n, "ldd", "stride_d"},
                           {"c", m, n, "ldc", "stride_c"},
                           {"bias", 1, a["epilogue"] == "bgrad_a" ? m : n, nullptr, nullptr}};
    for (const Operand& op : ops) {
      if (!a.count(op.name)) continue;
      int id = -1;
      if (!buffer_ref(a[op.name], &id)) return false;
      uint64_t ld = op.cols, stride = 0;
      if (op.ld && !num(a, op.ld, &ld)) return false;
      if (op.stride && a.count(op.stride) && !num(a, op.stride, &stride)) return false;
      if (ld < op.cols) return fail("gemm: " + std::string(op.ld) + "=" + std::to_string(ld) + " is less than " + std::to_string(op.cols) + " columns");
      if (op.rows == 0 || op.cols == 0 || batch == 0) continue;
      // Elements the operand spans: the last matrix's last element, plus one.
      uint64_t span = 0, t = 0;
      bool overflow = __builtin_mul_overflow(batch - 1, stride, &span) ||
                      __builtin_mul_overflow(op.rows - 1, ld, &t) || __builtin_add_overflow(span, t, &span) ||
                      __builtin_add_overflow(span, op.cols, &span);
      const PlanBuffer& buf = p_.buffers[static_cast<size_t>(id)];
      overflow = overflow || __builtin_mul_overflow(span, static_cast<uint64_t>(dtype_bits(buf.dtype)), &span);
      if (overflow || (span + 7) / 8 > buf.bytes)
        return fail("gemm: operand " + std::string(op.name) + " spans more than buffer " + std::to_string(id) + "'s " +
                    std::to_string(buf.bytes) + " bytes");
    }
    out->insert(a.begin(), a.end());
    return true;
  }

  /// A comma list of 1 to 3 integers of at least `min` ("3,3").
  bool dims(const Attrs& a, std::string_view key, int64_t min, std::vector<int64_t>* out) {
    const std::string& v = a.find(key)->second;
    for (std::string_view t : split(v, ',')) {
      int64_t d = 0;
      if (!parse_num(t, &d) || d < min || d > (int64_t{1} << 31) - 1)
        return fail("conv: " + std::string(key) + "='" + v + "' is not a list of integers >= " + std::to_string(min));
      out->push_back(d);
    }
    if (out->size() > 3) return fail("conv: " + std::string(key) + "='" + v + "' has more than 3 spatial dims");
    return true;
  }

  /// Checks a conv's attributes (NC + 1 to 3 spatial dims, symmetric padding) and that x, w, y,
  /// bias and z each fit their buffer and have the conv's dtype.
  bool conv(const std::vector<std::string_view>& toks, std::map<std::string, std::string>* out) {
    Attrs a;
    if (!attrs(toks, 2, &a,
               {"x", "w", "y", "n", "c", "k", "spatial", "kernel", "pad", "stride", "dilation", "groups", "dtype",
                "math", "activation"},
               {"bias", "z", "algo", "algo_math", "layout"}))
      return false;
    if (!conv_algo(a)) return false;
    if (a.count("layout") && a["layout"] != "nchw" && a["layout"] != "nhwc")
      return fail("conv: layout='" + a["layout"] + "' is not nchw or nhwc");
    auto one_of = [&](std::string_view key, std::initializer_list<std::string_view> allowed) {
      if (std::find(allowed.begin(), allowed.end(), a[std::string(key)]) != allowed.end()) return true;
      return fail("conv: " + std::string(key) + "='" + a[std::string(key)] + "' is not allowed");
    };
    if (!one_of("dtype", {"f32", "f16", "bf16"}) || !one_of("math", {"f32", "tf32"}) ||
        !one_of("activation", {"none", "relu"}))
      return false;
    if (a["math"] == "tf32" && a["dtype"] != "f32") return fail("conv: math=tf32 needs dtype=f32");
    uint64_t n = 0, c = 0, k = 0, groups = 0;
    if (!num(a, "n", &n) || !num(a, "c", &c) || !num(a, "k", &k) || !num(a, "groups", &groups)) return false;
    if (n == 0 || c == 0 || k == 0 || groups == 0) return fail("conv: n, c, k and groups must be positive");
    if (c % groups || k % groups)
      return fail("conv: groups=" + std::to_string(groups) + " does not divide c=" + std::to_string(c) + " and k=" +
                  std::to_string(k));
    std::vector<int64_t> in, ker, pad, stride, dil;
    if (!dims(a, "spatial", 1, &in) || !dims(a, "kernel", 1, &ker) || !dims(a, "pad", 0, &pad) ||
        !dims(a, "stride", 1, &stride) || !dims(a, "dilation", 1, &dil))
      return false;
    if (ker.size() != in.size() || pad.size() != in.size() || stride.size() != in.size() || dil.size() != in.size())
      return fail("conv: spatial, kernel, pad, stride and dilation must have the same number of dims");
    // Elements of x, w and y; the output extent follows from the others.
    uint64_t xe = n * c, we = k * (c / groups), ye = n * k;
    bool overflow = false;
    for (size_t d = 0; d < in.size(); ++d) {
      const int64_t span = dil[d] * (ker[d] - 1) + 1, padded = in[d] + 2 * pad[d];
      if (padded < span)
        return fail("conv: kernel dim " + std::to_string(d) + " (" + std::to_string(span) + " with dilation) exceeds the " +
                    "padded input (" + std::to_string(padded) + ")");
      const uint64_t o = static_cast<uint64_t>((padded - span) / stride[d] + 1);
      overflow |= __builtin_mul_overflow(xe, static_cast<uint64_t>(in[d]), &xe) ||
                  __builtin_mul_overflow(we, static_cast<uint64_t>(ker[d]), &we) || __builtin_mul_overflow(ye, o, &ye);
    }
    if (overflow) return fail("conv: tensor sizes overflow");
    const uint64_t es = a["dtype"] == "f32" ? 4 : 2;
    const std::pair<const char*, uint64_t> operands[] = {{"x", xe}, {"w", we}, {"y", ye}, {"z", ye}, {"bias", k}};
    for (const auto& [key, elems] : operands) {
      if (!a.count(key)) continue;
      int id = -1;
      if (!buffer_ref(a[key], &id)) return false;
      const PlanBuffer& buf = p_.buffers[static_cast<size_t>(id)];
      if (buf.dtype != a["dtype"])
        return fail("conv: " + std::string(key) + " buffer " + std::to_string(id) + " is " + buf.dtype + ", the conv is " +
                    a["dtype"]);
      if (elems > buf.bytes / es)
        return fail("conv: " + std::string(key) + " needs " + std::to_string(elems) + " elements, buffer " +
                    std::to_string(id) + " has " + std::to_string(buf.bytes) + " bytes");
    }
    out->insert(a.begin(), a.end());
    return true;
  }

  /// A conv's tuned algo= and algo_math= come together, name cuDNN forward algorithms and math
  /// types, and keep strict f32 (math=f32) off tensor-core math and the FFT and Winograd transforms.
  bool conv_algo(Attrs& a) {
    if (!a.count("algo") && !a.count("algo_math")) return true;
    if (!a.count("algo") || !a.count("algo_math")) return fail("conv: algo= and algo_math= must be given together");
    auto known = [](const auto& names, const std::string& v) {
      return std::find(std::begin(names), std::end(names), v) != std::end(names);
    };
    if (!known(kConvAlgoNames, a["algo"])) return fail("conv: algo='" + a["algo"] + "' is not a cuDNN forward algorithm");
    if (!known(kConvMathNames, a["algo_math"]))
      return fail("conv: algo_math='" + a["algo_math"] + "' is not default, tensor_op, tensor_op_allow_conversion or fma");
    if (a["dtype"] == "f32" && a["math"] == "f32" &&
        (a["algo_math"].starts_with("tensor_op") || a["algo"].starts_with("fft") || a["algo"].starts_with("winograd")))
      return fail("conv: algo=" + a["algo"] + " algo_math=" + a["algo_math"] + " is not exact enough for math=f32");
    return true;
  }

  /// FP8 operands (a_dtype/b_dtype f8e4m3fn or f8e5m2) need both scale pointers, the TN layout
  /// cuBLASLt's FP8 kernels take (trans_a=0 trans_b=1), 16-element leading dimensions, an f32
  /// compute type and a 16/32-bit d; scales and amax_d are f32 buffers.
  bool fp8_gemm(Attrs& a) {
    for (const char* key : {"a_dtype", "b_dtype"})
      if (a.count(key) && a[key] != a["dtype"] && a[key] != "f8e4m3fn" && a[key] != "f8e5m2" &&
          !(a["dtype"] == "f32" && (a[key] == "bf16" || a[key] == "f16")))
        return fail("gemm: " + std::string(key) + "='" + a[key] +
                    "' is not allowed (the gemm's dtype, f8e4m3fn or f8e5m2; bf16 or f16 into an f32 d)");
    const auto f8 = [&](const char* key) { return a.count(key) && a[key].starts_with("f8"); };
    const auto narrow = [&](const char* key) { return a.count(key) && a[key] != a["dtype"] && !f8(key); };
    if (narrow("a_dtype") || narrow("b_dtype")) {
      // bf16/f16 products summed into an f32 d (a gradient accumulated with beta 1).
      if (a["a_dtype"] != a["b_dtype"]) return fail("gemm: a bf16/f16 a_dtype needs the same b_dtype");
      if (a["compute"] != "f32") return fail("gemm: bf16/f16 operands into an f32 d need compute=f32");
      if (a.count("bias") || a["epilogue"] != "none") return fail("gemm: bf16/f16 operands into an f32 d take no epilogue");
    }
    if (!f8("a_dtype") && !f8("b_dtype")) {
      for (const char* key : {"a_scale", "b_scale", "amax_d", "fast_accum"})
        if (a.count(key)) return fail("gemm: " + std::string(key) + "= is only for fp8 operands (a_dtype/b_dtype)");
      return true;
    }
    if (a.count("fast_accum") && a["fast_accum"] != "0" && a["fast_accum"] != "1")
      return fail("gemm: fast_accum='" + a["fast_accum"] + "' is not 0 or 1");
    if (!f8("a_dtype") || !f8("b_dtype")) return fail("gemm: fp8 needs both a_dtype and b_dtype to be f8e4m3fn or f8e5m2");
    if (a["a_dtype"] == "f8e5m2" && a["b_dtype"] == "f8e5m2") return fail("gemm: fp8 cannot multiply f8e5m2 by f8e5m2");
    if (!a.count("a_scale") || !a.count("b_scale")) return fail("gemm: fp8 needs a_scale= and b_scale=");
    if (a["trans_a"] != "0" || a["trans_b"] != "1") return fail("gemm: fp8 needs trans_a=0 trans_b=1 (cuBLASLt's TN layout)");
    if (a["compute"] != "f32") return fail("gemm: fp8 needs compute=f32");
    uint64_t lda = 0, ldb = 0;
    if (!num(a, "lda", &lda) || !num(a, "ldb", &ldb)) return false;
    if (lda % 16 || ldb % 16) return fail("gemm: fp8 needs lda and ldb to be multiples of 16");
    for (const char* key : {"a_scale", "b_scale", "amax_d"}) {
      if (!a.count(key)) continue;
      int id = -1;
      if (!buffer_ref(a[key], &id)) return false;
      const PlanBuffer& buf = p_.buffers[static_cast<size_t>(id)];
      if (buf.dtype != "f32" || buf.bytes < 4)
        return fail("gemm: " + std::string(key) + " buffer " + std::to_string(id) + " must hold an f32, it is " + buf.dtype);
    }
    return true;
  }

  Plan& p_;
  std::string* error_;
  int line_ = 0;
  int stage_ = -1;
};

std::string join(const std::vector<std::string>& v, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

std::string json_string(std::string_view s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

const char* section_kind_name(uint32_t kind) {
  switch (kind) {
    case kSectionMeta: return "meta";
    case kSectionPlan: return "plan";
    case kSectionImage: return "image";
    case kSectionWeights: return "weights";
    case kSectionSource: return "source";
    case kSectionProgram: return "program";
    default: return "unknown";
  }
}

}  // namespace

bool parse_plan(std::string_view text, Plan* out, std::string* error) {
  *out = Plan();
  return PlanParser(out, error).parse(text);
}

int64_t mesh_ranks(const Plan& plan) {
  int64_t n = 1;
  for (const MeshAxis& a : plan.mesh) n *= a.size;
  return n;
}

std::string mesh_text(const Plan& plan) {
  std::string s;
  for (const MeshAxis& a : plan.mesh) s += (s.empty() ? "" : ",") + a.name + ":" + std::to_string(a.size);
  return s;
}

std::string placement_text(const std::vector<PlanPlacement>& placement) {
  std::string s;
  for (const PlanPlacement& p : placement) {
    s += s.empty() ? "" : ",";
    switch (p.kind) {
      case PlanPlacement::Kind::kReplicate: s += "R"; break;
      case PlanPlacement::Kind::kShard: s += "S(" + std::to_string(p.dim) + ")"; break;
      case PlanPlacement::Kind::kPartial: s += "P(" + p.reduce + ")"; break;
    }
  }
  return s;
}

std::unique_ptr<Artifact> read_artifact(std::string bytes, const std::string& name, std::string* error) {
  auto a = std::make_unique<Artifact>();
  a->storage = std::make_shared<const std::string>(std::move(bytes));
  const std::string& b = *a->storage;
  const uint64_t size = b.size();
  auto fail = [&](const std::string& msg) {
    if (error) *error = name + ": " + msg;
    return nullptr;
  };

  const bool magic_ok = std::memcmp(b.data(), kMagic, std::min<size_t>(b.size(), sizeof(kMagic))) == 0;
  if (!magic_ok || b.empty()) return fail("not a Kiln artifact (bad magic)");
  if (size < sizeof(Header))
    return fail("truncated: " + std::to_string(size) + " bytes, shorter than the " + std::to_string(sizeof(Header)) +
                "-byte header");
  a->format_version = static_cast<uint32_t>(get_le(b, 8, 4));
  if (a->format_version != kFormatVersion)
    return fail("format version " + std::to_string(a->format_version) + "; this runtime reads " +
                std::to_string(kFormatVersion));
  const uint64_t count = get_le(b, 12, 4), table = get_le(b, 16, 8), file_size = get_le(b, 24, 8);
  if (file_size != size)
    return fail((size < file_size ? "truncated: " : "size mismatch: ") + std::to_string(size) + " bytes, header says " +
                std::to_string(file_size));
  const uint64_t table_bytes = count * sizeof(SectionEntry);  // count < 2^32: no overflow
  if (table < sizeof(Header) || !fits(table, table_bytes, size))
    return fail("section table (offset " + std::to_string(table) + ", " + std::to_string(count) +
                " entries) lies outside the file");
  if (fnv1a64(b.data() + table, table_bytes) != get_le(b, 32, 8)) return fail("corrupt section table (checksum mismatch)");

  // Every byte range claimed: the header, the table, then each section; none may overlap.
  std::vector<std::pair<std::pair<uint64_t, uint64_t>, std::string>> ranges = {
      {{0, sizeof(Header)}, "the header"}, {{table, table + table_bytes}, "the section table"}};
  std::set<std::string> names;
  const Section* meta = nullptr;
  const Section* plan = nullptr;
  for (uint64_t i = 0; i < count; ++i) {
    const uint64_t at = table + i * sizeof(SectionEntry);
    Section s;
    s.kind = static_cast<uint32_t>(get_le(b, at, 4));
    s.offset = get_le(b, at + 8, 8);
    s.size = get_le(b, at + 16, 8);
    const char* raw_name = b.data() + at + 32;
    const size_t name_len = strnlen(raw_name, sizeof(SectionEntry::name));
    if (name_len == 0 || name_len == sizeof(SectionEntry::name))
      return fail("section " + std::to_string(i) + " has an empty or unterminated name");
    s.name.assign(raw_name, name_len);
    const std::string what = "section '" + s.name + "'";
    if (!names.insert(s.name).second) return fail("two sections named '" + s.name + "'");
    if (!fits(s.offset, s.size, size))
      return fail(what + " (offset " + std::to_string(s.offset) + ", " + std::to_string(s.size) +
                  " bytes) lies outside the file of " + std::to_string(size) + " bytes");
    const uint64_t align = s.kind == kSectionWeights ? kWeightsAlign : kSectionAlign;
    if (s.offset % align) return fail(what + " is not " + std::to_string(align) + "-byte aligned");
    if (fnv1a64(b.data() + s.offset, s.size) != get_le(b, at + 24, 8)) return fail("corrupt " + what + " (checksum mismatch)");
    if (s.size) ranges.push_back({{s.offset, s.offset + s.size}, what});
    a->sections.push_back(s);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].first.first < ranges[i - 1].first.second)
      return fail(ranges[i - 1].second + " and " + ranges[i].second + " overlap");

  for (const Section& s : a->sections) {
    const std::string_view bytes_view(b.data() + s.offset, s.size);
    const std::string what = "section '" + s.name + "'";
    if (s.kind == kSectionMeta || s.kind == kSectionPlan || s.kind == kSectionWeights) {
      if (s.name != section_kind_name(s.kind))
        return fail(what + " of kind " + section_kind_name(s.kind) + " must be named '" + section_kind_name(s.kind) + "'");
    }
    if (s.kind == kSectionMeta) meta = &s;
    if (s.kind == kSectionPlan) plan = &s;
    if (s.kind == kSectionWeights) a->weights = bytes_view;
    if (s.kind == kSectionImage) {
      const size_t dot = s.name.rfind('.');
      if (dot == 0 || dot == std::string::npos || dot + 1 == s.name.size())
        return fail("image " + what + " is not named TARGET.FORM");
      a->images.emplace(s.name, bytes_view);
    }
    if (s.kind == kSectionSource) {
      if (!s.name.ends_with(".cu") || s.name.size() == 3) return fail("source " + what + " is not named TARGET.cu");
      a->sources.emplace(s.name.substr(0, s.name.size() - 3), bytes_view);
    }
    if (s.kind == kSectionProgram) {
      const std::string k = std::to_string(a->programs.size());
      if (s.name != "program." + k) return fail("program " + what + " is not named 'program." + k + "' (in order)");
      a->programs.push_back(bytes_view);
    }
  }
  if (!meta) return fail("missing section 'meta'");
  if (!plan && a->programs.empty()) return fail("missing section 'plan'");
  if (plan && !a->programs.empty()) return fail("holds both a plan and per-rank programs");

  int line_no = 0;
  for (std::string_view line : split(std::string_view(b.data() + meta->offset, meta->size), '\n')) {
    ++line_no;
    if (line.empty()) continue;
    const size_t eq = line.find('=');
    if (eq == 0 || eq == std::string_view::npos)
      return fail("meta line " + std::to_string(line_no) + ": expected key=value");
    if (!a->meta.emplace(std::string(line.substr(0, eq)), std::string(line.substr(eq + 1))).second)
      return fail("meta key '" + std::string(line.substr(0, eq)) + "' appears twice");
  }
  if (auto v = a->meta.find("format_version"); v != a->meta.end() && v->second != std::to_string(a->format_version))
    return fail("meta format_version '" + v->second + "' differs from the header's " + std::to_string(a->format_version));

  if (!a->programs.empty()) {  // per-rank programs: each is read when a rank picks it
    const auto ranks = a->meta.find("rank_programs");
    if (ranks == a->meta.end()) return fail("holds per-rank programs but no meta 'rank_programs'");
    std::vector<bool> used(a->programs.size(), false);
    for (std::string_view k : split(ranks->second, ',')) {
      uint64_t index = 0;
      const auto [end, ec] = std::from_chars(k.data(), k.data() + k.size(), index);
      if (ec != std::errc() || end != k.data() + k.size() || index >= a->programs.size())
        return fail("meta rank_programs '" + ranks->second + "': '" + std::string(k) + "' is not a program (0.." +
                    std::to_string(a->programs.size() - 1) + ")");
      used[index] = true;
      a->rank_programs.push_back(static_cast<int>(index));
    }
    for (size_t k = 0; k < used.size(); ++k)
      if (!used[k]) return fail("program." + std::to_string(k) + " is no rank's program");
    return a;
  }
  a->plan_text = std::string_view(b.data() + plan->offset, plan->size);
  std::string plan_error;
  if (!parse_plan(a->plan_text, &a->plan, &plan_error)) return fail(plan_error);
  for (const PlanBuffer& buf : a->plan.buffers) {
    if (buf.kind != PlanBuffer::Kind::kWeight) continue;
    const std::string what = "plan: buffer " + std::to_string(buf.id) + (buf.name.empty() ? "" : " (" + buf.name + ")");
    if (buf.offset % kTensorAlign)
      return fail(what + ": weight offset " + std::to_string(buf.offset) + " is not " + std::to_string(kTensorAlign) +
                  "-byte aligned");
    if (!fits(buf.offset, buf.bytes, a->weights.size()))
      return fail(what + ": bytes [" + std::to_string(buf.offset) + ", +" + std::to_string(buf.bytes) +
                  ") outside the weights section of " + std::to_string(a->weights.size()) + " bytes");
    if (buf.rank_axis.empty()) continue;
    // One block per position along the axis, each aligned like a weight of its own.
    int64_t group = 1;
    for (const MeshAxis& ax : a->plan.mesh)
      if (ax.name == buf.rank_axis) group = ax.size;
    const uint64_t last = buf.offset + static_cast<uint64_t>(group - 1) * buf.rank_stride;  // no overflow: parsed
    if (buf.rank_stride % kTensorAlign || buf.rank_stride < buf.bytes)
      return fail(what + ": rank_stride " + std::to_string(buf.rank_stride) + " is not a multiple of " +
                  std::to_string(kTensorAlign) + " holding its " + std::to_string(buf.bytes) + " bytes");
    if (!fits(last, buf.bytes, a->weights.size()))
      return fail(what + ": the last rank's bytes [" + std::to_string(last) + ", +" + std::to_string(buf.bytes) +
                  ") lie outside the weights section of " + std::to_string(a->weights.size()) + " bytes");
  }
  return a;
}

std::unique_ptr<Artifact> rank_program(const Artifact& a, int64_t rank, const std::string& name, std::string* error) {
  const int64_t ranks = static_cast<int64_t>(a.rank_programs.size());
  if (rank < 0 || rank >= ranks) {
    if (error) *error = name + ": rank " + std::to_string(rank) + " is not one of its " + std::to_string(ranks) + " ranks";
    return nullptr;
  }
  const int k = a.rank_programs[static_cast<size_t>(rank)];
  const std::string who = name + " (program." + std::to_string(k) + ", rank " + std::to_string(rank) + "'s)";
  auto p = read_artifact(std::string(a.programs[static_cast<size_t>(k)]), who, error);
  if (!p) return nullptr;
  if (!p->programs.empty()) {
    if (error) *error = who + ": holds per-rank programs of its own";
    return nullptr;
  }
  if (mesh_ranks(p->plan) != ranks) {
    if (error)
      *error = who + ": its plan runs on a mesh of " + std::to_string(mesh_ranks(p->plan)) + " ranks (" +
               mesh_text(p->plan) + "), but the artifact lists programs for " + std::to_string(ranks);
    return nullptr;
  }
  return p;
}

bool select_rank_program(std::unique_ptr<Artifact>& a, int64_t rank, int64_t world_size, const std::string& launcher,
                         const std::string& name, std::string* error) {
  if (a->rank_programs.empty()) return true;
  const int64_t ranks = static_cast<int64_t>(a->rank_programs.size());
  if (world_size != ranks) {
    if (error)
      *error = name + " holds the programs of " + std::to_string(ranks) + " ranks (each rank runs its own), but " +
               (launcher.empty() ? std::string("this run") : launcher) + " started " + std::to_string(world_size) +
               " rank" + (world_size == 1 ? "" : "s") + ": start exactly " + std::to_string(ranks) + " process" +
               (ranks == 1 ? "" : "es") + " (e.g. kiln launch -n " + std::to_string(ranks) + " -- ...)";
    return false;
  }
  auto p = rank_program(*a, rank, name, error);
  if (!p) return false;
  a = std::move(p);
  return true;
}

std::unique_ptr<Artifact> read_artifact_file(const std::string& path, std::string* error) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    if (error) *error = "cannot read '" + path + "': it is a directory";
    return nullptr;
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    if (error) *error = "cannot read '" + path + "': " + std::strerror(errno);
    return nullptr;
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) {
    if (error) *error = "cannot read '" + path + "': read failed";
    return nullptr;
  }
  return read_artifact(std::move(ss).str(), path, error);
}

namespace {

/// Targets by name: meta's list, else the targets of the images.
std::vector<std::string> artifact_targets(const Artifact& a) {
  std::vector<std::string> out;
  if (auto t = a.meta.find("targets"); t != a.meta.end())
    for (std::string_view s : split(t->second, ','))
      if (!s.empty()) out.emplace_back(s);
  if (out.empty())
    for (const auto& [name, bytes] : a.images) {
      const std::string target = name.substr(0, name.rfind('.'));
      if (std::find(out.begin(), out.end(), target) == out.end()) out.push_back(target);
    }
  return out;
}

std::string buffer_type(const PlanBuffer& b) {
  std::string s = b.dtype + "[";
  for (size_t i = 0; i < b.shape.size(); ++i) s += (i ? ", " : "") + std::to_string(b.shape[i]);
  return s + "]";
}

}  // namespace

namespace {

std::string meta_value(const Artifact& a, const char* key) {
  auto it = a.meta.find(key);
  return it == a.meta.end() ? std::string("?") : it->second;
}

/// "format version 1, kiln 0.1.0, created by kiln compile from model.onnx\n"
std::string origin_line(const Artifact& a) {
  return "format version " + std::to_string(a.format_version) + ", kiln " + meta_value(a, "kiln_version") +
         ", created by " + meta_value(a, "created_by") + " from " + meta_value(a, "model") + "\n";
}

/// An artifact of per-rank programs: which ranks run which program, then each program.
std::string describe_rank_programs(const Artifact& a, bool json) {
  std::ostringstream o;
  std::vector<std::vector<int64_t>> ranks_of(a.programs.size());
  for (size_t r = 0; r < a.rank_programs.size(); ++r)
    ranks_of[static_cast<size_t>(a.rank_programs[r])].push_back(static_cast<int64_t>(r));
  std::vector<std::string> described;
  for (size_t k = 0; k < a.programs.size(); ++k) {
    std::string error;
    auto p = rank_program(a, ranks_of[k].front(), "program." + std::to_string(k), &error);
    described.push_back(p ? describe(*p, json) : (json ? "{\"error\": " + json_string(error) + "}" : error + "\n"));
  }
  auto ranks_text = [](const std::vector<int64_t>& v) {
    std::string s;
    for (int64_t r : v) s += (s.empty() ? "" : ", ") + std::to_string(r);
    return s;
  };
  if (json) {
    o << "{\"format_version\": " << a.format_version << ", \"meta\": {";
    bool first = true;
    for (const auto& [k, v] : a.meta) o << (std::exchange(first, false) ? "" : ", ") << json_string(k) << ": " << json_string(v);
    o << "}, \"rank_programs\": [" << ranks_text({a.rank_programs.begin(), a.rank_programs.end()}) << "], \"programs\": [";
    for (size_t k = 0; k < described.size(); ++k) {
      std::string d = described[k];
      while (!d.empty() && d.back() == '\n') d.pop_back();
      o << (k ? ", " : "") << d;
    }
    o << "]}\n";
    return o.str();
  }
  o << origin_line(a) << "pipeline: " << meta_value(a, "pipeline") << "\n"
    << "per-rank programs: " << a.programs.size() << " for " << a.rank_programs.size()
    << " ranks (each rank loads its own by its rank number)\n";
  for (size_t k = 0; k < described.size(); ++k) {
    o << "program." << k << " (rank" << (ranks_of[k].size() == 1 ? " " : "s ") << ranks_text(ranks_of[k]) << "):\n";
    for (std::string_view line : split(described[k], '\n'))
      if (!line.empty()) o << "  " << line << "\n";
  }
  return o.str();
}

}  // namespace

std::string describe(const Artifact& a, bool json) {
  if (!a.rank_programs.empty()) return describe_rank_programs(a, json);
  const Plan& p = a.plan;
  const std::vector<std::string> targets = artifact_targets(a);
  std::ostringstream o;
  if (json) {
    auto list = [&](const std::vector<std::string>& v) {
      std::string s = "[";
      for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + json_string(v[i]);
      return s + "]";
    };
    auto io = [&](const std::vector<std::pair<std::string, int>>& v, const std::vector<std::vector<PlanPlacement>>& pl) {
      std::string s = "[";
      for (size_t i = 0; i < v.size(); ++i) {
        const PlanBuffer& b = p.buffers[static_cast<size_t>(v[i].second)];
        std::string shape;
        for (size_t d = 0; d < b.shape.size(); ++d) shape += (d ? ", " : "") + std::to_string(b.shape[d]);
        s += std::string(i ? ", " : "") + "{\"name\": " + json_string(v[i].first) + ", \"buffer\": " +
             std::to_string(b.id) + ", \"dtype\": " + json_string(b.dtype) + ", \"shape\": [" + shape + "], \"bytes\": " +
             std::to_string(b.bytes) +
             (p.mesh.empty() ? "" : ", \"placement\": " + json_string(placement_text(pl[i]))) + "}";
      }
      return s + "]";
    };
    o << "{\"format_version\": " << a.format_version << ", \"meta\": {";
    bool first = true;
    for (const auto& [k, v] : a.meta) o << (std::exchange(first, false) ? "" : ", ") << json_string(k) << ": " << json_string(v);
    o << "}, \"targets\": " << list(targets) << ", \"images\": [";
    first = true;
    for (const Section& s : a.sections) {
      if (s.kind != kSectionImage) continue;
      const size_t dot = s.name.rfind('.');
      o << (std::exchange(first, false) ? "" : ", ") << "{\"name\": " << json_string(s.name)
        << ", \"target\": " << json_string(s.name.substr(0, dot)) << ", \"form\": " << json_string(s.name.substr(dot + 1))
        << ", \"bytes\": " << s.size << "}";
    }
    o << "], \"sections\": [";
    first = true;
    for (const Section& s : a.sections)
      o << (std::exchange(first, false) ? "" : ", ") << "{\"kind\": " << json_string(section_kind_name(s.kind))
        << ", \"name\": " << json_string(s.name) << ", \"offset\": " << s.offset << ", \"size\": " << s.size << "}";
    o << "], \"mesh\": " << json_string(mesh_text(p)) << ", \"inputs\": " << io(p.inputs, p.input_placements)
      << ", \"outputs\": " << io(p.outputs, p.output_placements) << ", \"steps\": " << p.steps.size()
      << ", \"kernels\": " << p.kernels.size() << ", \"weights_bytes\": " << a.weights.size()
      << ", \"arena_bytes\": " << p.arena_bytes << ", \"workspace_bytes\": " << p.workspace_bytes << "}\n";
    return o.str();
  }
  auto meta = [&](const char* key) { return meta_value(a, key); };
  o << origin_line(a) << "targets: " << join(targets, ", ") << "\n"
    << "pipeline: " << meta("pipeline") << "\n"
    << "plugins: " << meta("plugins") << "\n"
    << "cuda " << meta("cuda_version") << ", nvrtc " << meta("nvrtc_version") << "\n"
    << "images and sources:\n";
  for (const Section& s : a.sections)
    if (s.kind == kSectionImage || s.kind == kSectionSource) o << "  " << s.name << ": " << s.size << " bytes\n";
  if (!p.mesh.empty())
    o << "mesh: " << mesh_text(p) << " (" << mesh_ranks(p) << " ranks; each runs this plan on its own piece of the "
      << "inputs)\n";
  for (const auto& [label, list, pl] : {std::tuple{"inputs", &p.inputs, &p.input_placements},
                                        std::tuple{"outputs", &p.outputs, &p.output_placements}}) {
    o << label << ":\n";
    for (size_t i = 0; i < list->size(); ++i) {
      const auto& [name, id] = (*list)[i];
      o << "  " << name << ": " << buffer_type(p.buffers[static_cast<size_t>(id)]);
      if (!p.mesh.empty()) o << " " << ((*pl)[i].empty() ? std::string("replicated") : placement_text((*pl)[i]));
      o << "\n";
    }
  }
  std::map<std::string, int> step_kinds;
  static const char* kStepNames[] = {"launch", "gemm", "copy", "memset", "conv", "collective"};
  for (const PlanStep& s : p.steps) ++step_kinds[kStepNames[static_cast<int>(s.kind)]];
  std::vector<std::string> counts;
  for (const auto& [k, n] : step_kinds) counts.push_back(std::to_string(n) + " " + k);
  o << "plan: steps " << p.steps.size() << (counts.empty() ? "" : " (" + join(counts, ", ") + ")") << ", kernels "
    << p.kernels.size() << ", buffers " << p.buffers.size() << "\n"
    << "memory: weights " << a.weights.size() << " bytes, arena " << p.arena_bytes << " bytes, workspace "
    << p.workspace_bytes << " bytes\n";
  return o.str();
}

}  // namespace kiln::artifact
