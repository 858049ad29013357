// The .kir printer: Graph to text (deterministic, re-parses to the same bytes), side files.
#include <bit>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <unordered_map>
#include <unordered_set>

#include "kiln/ir/text.h"
#include "text_lexer.h"

namespace kiln {
namespace {

static_assert(std::endian::native == std::endian::little, "side files assume a little-endian host");

constexpr int64_t kSideAlign = 64;

/// The printed name of every value of one graph (without '%'). Inputs claim their names
/// first, then results in order; empty or repeated names get the smallest unused number.
using Names = std::unordered_map<const Value*, std::string>;

Names assign_names(const Graph& g) {
  Names names;
  std::unordered_set<std::string> used;
  std::vector<const Value*> unnamed;
  auto claim = [&](const Value* v) {
    if (!v->name().empty() && used.insert(v->name()).second) names.emplace(v, v->name());
    else unnamed.push_back(v);
  };
  for (int i = 0; i < g.num_inputs(); ++i) claim(g.input(i));
  for (const auto& n : g.nodes())
    for (int i = 0; i < n->num_results(); ++i) claim(n->result(i));
  int64_t next = 0;
  for (const Value* v : unnamed) {
    std::string s;
    do s = std::to_string(next++);
    while (used.count(s));
    used.insert(s);
    names.emplace(v, std::move(s));
  }
  return names;
}

/// Streams large constants into the side file: 64-byte aligned, each storage written once.
class SideWriter {
 public:
  SideWriter(std::string tmp_path, std::string ref) : tmp_(std::move(tmp_path)), ref_(std::move(ref)) {}
  SideWriter(const SideWriter&) = delete;
  SideWriter& operator=(const SideWriter&) = delete;
  ~SideWriter() {
    if (f_) {
      std::fclose(f_);
      std::remove(tmp_.c_str());
    }
  }

  /// The path as the .kir spells it (relative to the .kir's folder).
  const std::string& ref() const { return ref_; }

  /// Appends `t`'s bytes (or finds them already written) and returns their offset.
  int64_t add(const Tensor& t) {
    const auto key = std::make_pair(t.data(), t.nbytes());
    if (auto it = seen_.find(key); it != seen_.end()) return it->second;
    if (!f_ && status_.ok()) {
      f_ = std::fopen(tmp_.c_str(), "wb");
      if (!f_) status_ = io_error("cannot write side file '" + tmp_ + "': " + std::strerror(errno));
    }
    const int64_t offset = (size_ + kSideAlign - 1) / kSideAlign * kSideAlign;
    if (f_ && status_.ok()) {
      static const char kZeros[kSideAlign] = {};
      const auto pad = static_cast<size_t>(offset - size_);
      if (std::fwrite(kZeros, 1, pad, f_) != pad ||
          std::fwrite(t.data(), 1, t.nbytes(), f_) != t.nbytes())
        status_ = io_error("cannot write side file '" + tmp_ + "': " + std::strerror(errno));
    }
    size_ = offset + static_cast<int64_t>(t.nbytes());
    seen_.emplace(key, offset);
    return offset;
  }

  /// Closes the file and moves it to `final_path` (when anything was written).
  Status finish(const std::string& final_path) {
    KILN_RETURN_IF_ERROR(status_);
    if (!f_) return ok_status();
    const bool failed = std::fclose(f_) != 0;
    f_ = nullptr;
    if (failed || std::rename(tmp_.c_str(), final_path.c_str()) != 0) {
      const Status s = io_error("cannot write side file '" + final_path + "': " + std::strerror(errno));
      std::remove(tmp_.c_str());
      return s;
    }
    return ok_status();
  }

 private:
  std::string tmp_;
  std::string ref_;
  std::FILE* f_ = nullptr;
  int64_t size_ = 0;
  std::map<std::pair<const std::byte*, size_t>, int64_t> seen_;
  Status status_;
};

struct PrintConfig {
  SideWriter* side = nullptr;        ///< large tensors go here when set
  size_t inline_limit = 0;           ///< ... when they have more bytes than this
  size_t elide_above = std::numeric_limits<size_t>::max();  ///< print "[...]" (diagnostics)
  bool one_line = false;
};

class Printer {
 public:
  Printer(std::string& out, PrintConfig cfg) : out_(out), cfg_(cfg) {}

  void graph(const Graph& g, int indent) {
    const Names names = assign_names(g);
    out_ += "graph ";
    kir::append_name(out_, '@', g.name());
    out_ += '(';
    for (int i = 0; i < g.num_inputs(); ++i) {
      if (i) out_ += ", ";
      value(names, g.input(i));
      out_ += ": ";
      value_type(*g.input(i));
    }
    out_ += ") -> (";
    for (int i = 0; i < g.num_outputs(); ++i) {
      if (i) out_ += ", ";
      // An output's name is spelled out only where the returned value is printed by another.
      const std::string& name = g.output_name(i);
      const auto it = g.output(i) ? names.find(g.output(i)) : names.end();
      if (!name.empty() && (it == names.end() || it->second != name)) {
        kir::append_name(out_, '%', name);
        out_ += ": ";
      }
      if (g.output(i)) value_type(*g.output(i));
      else out_ += "<null>";
    }
    out_ += ')';
    if (!g.parent_node() && !g.mesh().empty()) {
      out_ += " mesh";
      out_ += g.mesh().str();
      if (g.is_per_rank()) out_ += " per_rank";
    }
    out_ += " {";
    for (const auto& n : g.nodes()) {
      line_break(indent + 2);
      node(*n, names, indent + 2);
    }
    line_break(indent + 2);
    out_ += "return";
    for (int i = 0; i < g.num_outputs(); ++i) {
      out_ += i ? ", " : " ";
      value(names, g.output(i));
    }
    line_break(indent);
    out_ += '}';
  }

  /// A value's type followed by its placement, if any: "f32[8, 64]<S(0), R>".
  void value_type(const Value& v) {
    kir::append_type(out_, v.type());
    out_ += sharding_str(v.sharding());
  }

  void node(const Node& n, const Names& names, int indent) {
    for (int i = 0; i < n.num_results(); ++i) {
      if (i) out_ += ", ";
      value(names, n.result(i));
    }
    if (n.num_results()) out_ += " = ";
    out_ += n.op_name();
    out_ += '(';
    for (int i = 0; i < n.num_operands(); ++i) {
      if (i) out_ += ", ";
      value(names, n.operand(i));
    }
    out_ += ')';
    if (!n.attrs().empty()) {
      out_ += " {";
      bool first = true;
      for (const auto& [name, a] : n.attrs()) {
        if (!first) out_ += ", ";
        first = false;
        out_ += name;
        out_ += " = ";
        attr(a);
      }
      out_ += '}';
    }
    for (int i = 0; i < n.num_results(); ++i) {
      out_ += i ? ", " : " : ";
      value_type(*n.result(i));
    }
    if (n.num_regions()) {
      out_ += " {";
      for (int i = 0; i < n.num_regions(); ++i) {
        line_break(indent + 2);
        graph(n.region(i), indent + 2);
      }
      line_break(indent);
      out_ += '}';
    }
  }

 private:
  void line_break(int indent) {
    if (cfg_.one_line) {
      out_ += ' ';
    } else {
      out_ += '\n';
      out_.append(static_cast<size_t>(indent), ' ');
    }
  }

  void value(const Names& names, const Value* v) {
    if (!v) {
      kir::append_name(out_, '%', "<null>");
      return;
    }
    auto it = names.find(v);
    // A value of another graph (a broken region): its own name lets the parser say which.
    kir::append_name(out_, '%', it != names.end() ? it->second
                                : v->name().empty() ? "<outer>" : v->name());
  }

  void integer(int64_t v) {
    char buf[24];
    out_.append(buf, static_cast<size_t>(std::to_chars(buf, buf + sizeof buf, v).ptr - buf));
  }

  template <typename T, typename F>
  void list(const std::vector<T>& items, F&& each) {
    out_ += '[';
    for (size_t i = 0; i < items.size(); ++i) {
      if (i) out_ += ", ";
      each(items[i]);
    }
    out_ += ']';
  }

  void attr(const Attribute& a) {
    switch (a.kind()) {
      case AttrKind::kInt: integer(a.as_int()); return;
      case AttrKind::kFloat: kir::append_double(out_, a.as_float()); return;
      case AttrKind::kString: kir::append_quoted(out_, a.as_string()); return;
      case AttrKind::kInts: list(a.as_ints(), [&](int64_t v) { integer(v); }); return;
      case AttrKind::kFloats: list(a.as_floats(), [&](double v) { kir::append_double(out_, v); }); return;
      case AttrKind::kStrings:
        list(a.as_strings(), [&](const std::string& s) { kir::append_quoted(out_, s); });
        return;
      case AttrKind::kTensor: tensor(a.as_tensor()); return;
      case AttrKind::kDType: out_ += dtype_name(a.as_dtype()); return;
    }
  }

  void tensor(const Tensor& t) {
    out_ += "dense<";
    kir::append_type(out_, t.type());
    out_ += '>';
    const int64_t numel = t.numel();
    if (numel > 0 && t.data() == nullptr) {
      out_ += "[<undefined>]";
      return;
    }
    if (cfg_.side && t.nbytes() > cfg_.inline_limit) {
      out_ += "(file ";
      kir::append_quoted(out_, cfg_.side->ref());
      out_ += ", offset ";
      integer(cfg_.side->add(t));
      out_ += ')';
      return;
    }
    if (t.nbytes() > cfg_.elide_above) {
      out_ += "[...]";
      return;
    }
    out_ += '[';
    const DType dt = t.dtype();
    for (int64_t i = 0; i < numel; ++i) {
      if (i) out_ += ", ";
      if (is_float(dt)) kir::append_double(out_, t.get_f64(i));
      else if (dt == DType::kBool) out_ += t.get_i64(i) ? "true" : "false";
      else integer(t.get_i64(i));
    }
    out_ += ']';
  }

  std::string& out_;
  PrintConfig cfg_;
};

/// Writes `data` to `path` through a temporary file and a rename, so a reader (or an mmap of
/// the previous version) never sees a half-written file.
Status write_file(const std::string& path, const std::string& data) {
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) return io_error("cannot write '" + path + "': " + std::strerror(errno));
  const bool wrote = std::fwrite(data.data(), 1, data.size(), f) == data.size();
  const bool closed = std::fclose(f) == 0;
  if (!wrote || !closed || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const Status s = io_error("cannot write '" + path + "': " + std::strerror(errno));
    std::remove(tmp.c_str());
    return s;
  }
  return ok_status();
}

}  // namespace

std::string print_graph(const Graph& g) {
  std::string out;
  Printer(out, PrintConfig{}).graph(g, 0);
  out += '\n';
  return out;
}

std::string print_node(const Node& n) {
  std::string out;
  PrintConfig cfg;
  cfg.one_line = true;
  cfg.elide_above = PrintOptions{}.inline_limit_bytes;
  Printer p(out, cfg);
  if (n.graph()) p.node(n, assign_names(*n.graph()), 0);
  else p.node(n, Names{}, 0);
  return out;
}

Status print_graph_to_file(const Graph& g, const std::string& path, const PrintOptions& opts) {
  namespace fs = std::filesystem;
  std::unique_ptr<SideWriter> side;
  if (!opts.side_file.empty()) {
    std::error_code ec;
    const fs::path kir_dir = fs::absolute(path, ec).parent_path().lexically_normal();
    const fs::path side_path = fs::absolute(opts.side_file, ec).lexically_normal();
    const fs::path rel = side_path.lexically_relative(kir_dir);
    bool inside = !ec && !rel.empty() && rel != ".";
    for (const fs::path& part : rel) inside = inside && part != "..";
    if (!inside)
      return invalid_argument("side file '" + opts.side_file + "' must be in the folder of '" +
                              path + "' or below");
    side = std::make_unique<SideWriter>(opts.side_file + ".tmp", rel.generic_string());
  }
  std::string text;
  PrintConfig cfg;
  cfg.side = side.get();
  cfg.inline_limit = opts.inline_limit_bytes;
  Printer(text, cfg).graph(g, 0);
  text += '\n';
  if (side) KILN_RETURN_IF_ERROR(side->finish(opts.side_file));
  return write_file(path, text);
}

}  // namespace kiln
