// The null backend: the documented skeleton to copy when writing a backend; does nothing.
//
// Copy this folder to backends/<yours>/, rename the target in CMakeLists.txt
// (kiln_add_plugin(backend-<yours> SOURCES ...)), add the folder to backends/CMakeLists.txt,
// then replace each "unimplemented" below with real work, keeping the order of the steps.
// The steps are numbered in the order Kiln reaches them (0: the entry point, at the bottom)
// and defined bottom-up because C++ wants each class before its use. README.md next to this
// file walks through the same steps with the reasons behind them.
//
// A backend plugin includes only the SDK header kiln/plugin.h (which brings in the registry
// and the IR). It must not reach into core/ or ir/ sources: plugins are built against the
// installed SDK, out of tree as well as in tree.
#include <memory>
#include <span>
#include <vector>

#include "kiln/plugin.h"

// Everything but the entry point lives in an anonymous namespace: plugins are built with
// hidden visibility, and two plugins defining a class of the same name must not collide.
namespace {

/// Step 3: the compiled program. Whatever compile() produced (kernel images, an execution
/// plan, buffers for weights) lives here; the Executable owns it and must not point into the
/// Graph it was compiled from, because the caller may destroy that graph right after
/// compile() returns.
class NullExecutable final : public kiln::Executable {
 public:
  /// Runs the program. `inputs` come in graph-input order and nobody has checked them yet: a
  /// real backend compares their dtypes and shapes with the graph's inputs (the reference
  /// interpreter shows the expected messages) and returns outputs in graph-output order.
  /// Ownership of the inputs stays with the caller; copy what must outlive the call.
  kiln::StatusOr<std::vector<kiln::Tensor>> run(std::span<const kiln::Tensor> inputs) override {
    return kiln::unimplemented("null backend: Executable::run is unimplemented");
  }
};

/// Step 2: the backend object, created once per compile session with the resolved options.
/// Keep options here (not in globals): two pipelines in one process may use different ones.
class NullBackend final : public kiln::Backend {
 public:
  /// Lowers `g` into an Executable. A real backend typically:
  ///   1. verifies the graph it was given (kiln::verify), so a pass bug shows up as a
  ///      verifier message rather than a crash inside lowering;
  ///   2. refuses, with kUnimplemented and the node's location, every op it cannot lower,
  ///      naming the op and the backend: "sm90: 'gather' is not supported";
  ///   3. plans buffers, lowers each node (or each fused region) to a kernel, and stores
  ///      everything in a new Executable, copying the weights it needs:
  ///        return std::unique_ptr<kiln::Executable>(std::make_unique<NullExecutable>(...));
  /// Errors are returned as Status values; never throw out of a plugin, never abort.
  kiln::StatusOr<std::unique_ptr<kiln::Executable>> compile(const kiln::Graph& g) override {
    return kiln::unimplemented("null backend: compile is unimplemented");
  }
};

/// Step 1: describe the backend to the registry. The name is what pipelines and the CLI use
/// to pick it; the declared options are checked (unknown names, types) and defaulted before
/// create() is called, so create() can read every one of them.
kiln::Status register_null_backend(kiln::Registry& r) {
  kiln::BackendInfo info;
  info.name = "null";      // kebab-case, unique among backends
  info.version = "0.1.0";  // the plugin's own version; part of every cache key
  info.summary = "skeleton backend that compiles nothing; copy it to start a new backend";
  info.targets = {};       // what it can build for, e.g. {"sm_90a", "sm_100a"}
  // Options are declared with a type, a default and a help line, e.g.
  //   info.options = {{"max-registers", kiln::OptionType::kInt, int64_t{255}, "per thread"}};
  // and read in create() with o.get_int("max-registers"). The null backend declares none.
  info.create = [](const kiln::Options&) -> kiln::StatusOr<std::unique_ptr<kiln::Backend>> {
    // Check option values that their type alone does not rule out here (ranges, names),
    // with a message naming the option, and return kInvalidArgument when they are wrong.
    return std::unique_ptr<kiln::Backend>(std::make_unique<NullBackend>());
  };
  // add_backend refuses a second "null" from another library, naming both libraries.
  return r.add_backend(std::move(info));
}

}  // namespace

// Step 0: the entry point. The loader reads the ABI version and build fingerprint it returns
// before calling register_null_backend, and refuses a plugin built against another Kiln,
// compiler or standard library. Exactly one KILN_PLUGIN per shared library.
KILN_PLUGIN("kiln-backend-null", "0.1.0", register_null_backend)
