// Helpers for the onnx front end tests: build small models in code, write them, import them.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include <onnx/onnx_pb.h>

#include "kiln/core/loader.h"
#include "kiln/core/options.h"
#include "kiln/core/registry.h"
#include "kiln/ir/graph.h"

namespace kiln::onnx_test {

namespace fs = std::filesystem;

/// A fresh folder under the system temp folder, removed with its contents on destruction.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "kiln-onnx-test-XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data()) ? tmpl : std::string();
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

/// A dim of a declared shape: a size or a dim_param name.
using DimSpec = std::variant<int64_t, std::string>;

/// Builds a ModelProto one piece at a time (IR version 8, default opset 17 unless changed).
class ModelBuilder {
 public:
  explicit ModelBuilder(int64_t opset = 17) {
    m_.set_ir_version(8);
    m_.mutable_graph()->set_name("test");
    auto* o = m_.add_opset_import();
    o->set_domain("");
    o->set_version(opset);
  }

  onnx::ModelProto& proto() { return m_; }
  onnx::GraphProto& graph() { return *m_.mutable_graph(); }

  ModelBuilder& input(const std::string& name, int elem, std::vector<DimSpec> dims) {
    fill(graph().add_input(), name, elem, dims);
    return *this;
  }
  ModelBuilder& output(const std::string& name, int elem, std::vector<DimSpec> dims = {}) {
    fill(graph().add_output(), name, elem, dims, false);
    return *this;
  }
  onnx::NodeProto& node(const std::string& op, std::vector<std::string> inputs,
                        std::vector<std::string> outputs, const std::string& name = "") {
    auto* n = graph().add_node();
    n->set_op_type(op);
    n->set_name(name);
    for (auto& i : inputs) n->add_input(i);
    for (auto& o : outputs) n->add_output(o);
    return *n;
  }
  onnx::TensorProto& initializer(const std::string& name, std::vector<int64_t> dims,
                                 std::vector<float> values) {
    auto* t = graph().add_initializer();
    t->set_name(name);
    t->set_data_type(onnx::TensorProto::FLOAT);
    for (int64_t d : dims) t->add_dims(d);
    for (float v : values) t->add_float_data(v);
    return *t;
  }
  onnx::TensorProto& int_initializer(const std::string& name, std::vector<int64_t> dims,
                                     std::vector<int64_t> values) {
    auto* t = graph().add_initializer();
    t->set_name(name);
    t->set_data_type(onnx::TensorProto::INT64);
    for (int64_t d : dims) t->add_dims(d);
    for (int64_t v : values) t->add_int64_data(v);
    return *t;
  }

  void write(const std::string& path) const {
    std::ofstream out(path, std::ios::binary);
    m_.SerializeToOstream(&out);
  }

 private:
  static void fill(onnx::ValueInfoProto* vi, const std::string& name, int elem,
                   const std::vector<DimSpec>& dims, bool with_shape = true) {
    vi->set_name(name);
    auto* tt = vi->mutable_type()->mutable_tensor_type();
    tt->set_elem_type(elem);
    if (!with_shape && dims.empty()) return;
    auto* shape = tt->mutable_shape();
    for (const DimSpec& d : dims) {
      auto* dim = shape->add_dim();
      if (std::holds_alternative<int64_t>(d)) dim->set_dim_value(std::get<int64_t>(d));
      else dim->set_dim_param(std::get<std::string>(d));
    }
  }
  onnx::ModelProto m_;
};

inline void add_int_attr(onnx::NodeProto& n, const std::string& name, int64_t v) {
  auto* a = n.add_attribute();
  a->set_name(name);
  a->set_type(onnx::AttributeProto::INT);
  a->set_i(v);
}

inline void add_ints_attr(onnx::NodeProto& n, const std::string& name, std::vector<int64_t> v) {
  auto* a = n.add_attribute();
  a->set_name(name);
  a->set_type(onnx::AttributeProto::INTS);
  for (int64_t x : v) a->add_ints(x);
}

inline void add_float_attr(onnx::NodeProto& n, const std::string& name, float v) {
  auto* a = n.add_attribute();
  a->set_name(name);
  a->set_type(onnx::AttributeProto::FLOAT);
  a->set_f(v);
}

/// Points an initializer's data at an external file.
inline void set_external(onnx::TensorProto& t, const std::string& location, int64_t offset = -1,
                         int64_t length = -1) {
  t.clear_float_data();
  t.set_data_location(onnx::TensorProto::EXTERNAL);
  auto add = [&](const std::string& k, const std::string& v) {
    auto* e = t.add_external_data();
    e->set_key(k);
    e->set_value(v);
  };
  add("location", location);
  if (offset >= 0) add("offset", std::to_string(offset));
  if (length >= 0) add("length", std::to_string(length));
}

/// The process-wide registry with the onnx front end loaded from the build tree.
inline Registry& registry() {
  static bool loaded = [] {
    const std::string dir = KILN_PLUGIN_DIR;
    return load_plugin(dir + "/kiln-plugin-frontend-onnx.so", Registry::global()).ok() &&
           load_plugin(dir + "/kiln-plugin-backend-reference.so", Registry::global()).ok();
  }();
  (void)loaded;
  return Registry::global();
}

/// Imports `path` with the onnx front end and the given option values.
inline StatusOr<std::unique_ptr<Graph>> import(const std::string& path,
                                               const std::map<std::string, OptionValue>& given = {}) {
  KILN_ASSIGN_OR_RETURN(const FrontendInfo* fe, registry().frontend("onnx"));
  KILN_ASSIGN_OR_RETURN(Options opts, resolve_options(fe->options, given, "frontend 'onnx'"));
  return fe->import(path, opts);
}

/// Writes raw bytes to a file.
inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}

}  // namespace kiln::onnx_test
