// Reading .kiln artifacts and their execution plans (docs/artifact.md). C++, no CUDA: used by
// the runtime and by `kiln inspect`.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::artifact {

/// One axis of the device mesh a per-rank plan runs on (its `mesh` line): ranks are row-major
/// over the axes, the last varying fastest.
struct MeshAxis {
  std::string name;
  int64_t size = 1;
};

/// How a per-rank plan's input or output lies in the global tensor along one mesh axis:
/// replicated, split into equal contiguous blocks along `dim` (block k on group position k),
/// or one term of a sum or max over the axis' group.
struct PlanPlacement {
  enum class Kind { kReplicate, kShard, kPartial };
  Kind kind = Kind::kReplicate;
  int dim = 0;             ///< kShard
  std::string reduce;      ///< kPartial: "sum" or "max"
};

/// A parsed buffer line of the plan.
struct PlanBuffer {
  enum class Kind { kInput, kOutput, kActivation, kWeight, kAlias };
  int id = 0;
  Kind kind = Kind::kActivation;
  std::string dtype;                 ///< Kiln dtype name
  std::vector<int64_t> shape;        ///< empty for scalars
  uint64_t bytes = 0;
  uint64_t offset = 0;               ///< arena offset, weights offset, or offset into `base`
  int base = -1;                     ///< for aliases
  std::string name;
  /// Weights and aliases of a per-rank plan may differ by rank: this rank's bytes start at
  /// offset + coord * rank_stride, coord being its position along mesh axis rank_axis.
  std::string rank_axis;             ///< "" when the same for every rank
  uint64_t rank_stride = 0;
};

/// One argument of a kernel launch.
struct LaunchArg {
  enum class Kind { kBuffer, kInt64, kFloat32 };
  Kind kind = Kind::kBuffer;
  int buffer = -1;
  int64_t i64 = 0;
  float f32 = 0;
};

struct PlanStep {
  enum class Kind { kLaunch, kGemm, kCopy, kMemset, kConv, kCollective };
  Kind kind = Kind::kLaunch;
  // launch
  std::string kernel;
  uint32_t grid[3] = {1, 1, 1};
  uint32_t block[3] = {1, 1, 1};
  uint32_t smem = 0;
  std::vector<LaunchArg> args;
  // gemm, copy, memset, conv, collective: named attributes as written (a, b, d, m, n, ... src,
  // dst, bytes; op, axis, x, y, count, dtype, reduce, root, peer, tag)
  std::map<std::string, std::string> attrs;
  int line = 0;  ///< line in the plan text, for messages
};

/// Plan names of cuDNN's forward convolution algorithms and math types, in the order of
/// cudnnConvolutionFwdAlgo_t and cudnnMathType_t: a conv step's tuned algo= and algo_math=.
inline constexpr const char* kConvAlgoNames[] = {"implicit_gemm", "implicit_precomp_gemm", "gemm", "direct",
                                                 "fft", "fft_tiling", "winograd", "winograd_nonfused"};
inline constexpr const char* kConvMathNames[] = {"default", "tensor_op", "tensor_op_allow_conversion", "fma"};
/// Hex digits of a gemm step's tuned algo= (a serialized 64-byte cublasLtMatmulAlgo_t).
inline constexpr size_t kGemmAlgoHexDigits = 128;

struct Plan {
  uint64_t arena_bytes = 0;
  uint64_t workspace_bytes = 0;
  std::vector<PlanBuffer> buffers;
  std::vector<std::pair<std::string, int>> inputs;   ///< name, buffer id
  std::vector<std::pair<std::string, int>> outputs;
  /// Persistent state (training weights, optimizer state): name, weight buffer id.
  std::vector<std::pair<std::string, int>> variables;
  /// Variables that are copies of another (`copy_of=`, a weight's low-precision copy that the
  /// step keeps next to it): copy name -> the name of the variable it copies.
  std::map<std::string, std::string> variable_copies;
  /// Per-rank plans: the device mesh (empty for a single-device plan) and each input's and
  /// output's placement, parallel to `inputs` and `outputs` (one entry per mesh axis; empty
  /// when the line gives none, which means replicated).
  std::vector<MeshAxis> mesh;
  std::vector<std::vector<PlanPlacement>> input_placements, output_placements;
  std::vector<std::string> kernels;
  std::vector<PlanStep> steps;
};

struct Section {
  uint32_t kind = 0;
  std::string name;
  uint64_t offset = 0;
  uint64_t size = 0;
};

/// A validated artifact. Views point into the bytes held by `storage`.
struct Artifact {
  std::shared_ptr<const std::string> storage;
  uint32_t format_version = 0;
  std::vector<Section> sections;
  std::map<std::string, std::string> meta;
  std::string_view plan_text;
  Plan plan;
  std::string_view weights;
  /// image name ("sm_90a.cubin", "compute_90a.ptx") → bytes
  std::map<std::string, std::string_view> images;
  std::map<std::string, std::string_view> sources;
  /// An artifact whose ranks run different programs (a pipeline's stages) holds no plan, but
  /// one whole artifact per distinct program (`program.K` sections) and which one each rank
  /// runs (meta `rank_programs`); both empty otherwise. rank_program() reads a rank's.
  std::vector<std::string_view> programs;
  std::vector<int> rank_programs;
};

/// Parses and validates (header, checksums, bounds, plan syntax and references). On failure
/// returns nullptr and sets `error` to a message naming `name` (the file) and the problem.
std::unique_ptr<Artifact> read_artifact(std::string bytes, const std::string& name,
                                        std::string* error);
std::unique_ptr<Artifact> read_artifact_file(const std::string& path, std::string* error);

/// Rank `rank`'s program of an artifact of per-rank programs, read and validated like an
/// artifact of its own; its mesh must have as many ranks as the outer artifact lists. On
/// failure returns nullptr and sets `error`.
std::unique_ptr<Artifact> rank_program(const Artifact& a, int64_t rank, const std::string& name, std::string* error);

/// Where `a` holds per-rank programs, replaces it by rank `rank`'s, first checking that the run
/// has as many ranks (`world_size`, started by `launcher`) as the artifact; a plain artifact is
/// left as it is. On failure returns false and sets `error`.
bool select_rank_program(std::unique_ptr<Artifact>& a, int64_t rank, int64_t world_size, const std::string& launcher,
                         const std::string& name, std::string* error);

/// Parses plan text; error messages are "plan:LINE: ...".
bool parse_plan(std::string_view text, Plan* out, std::string* error);

/// The collective ops a plan's `step collective op=...` may name, in this order.
inline constexpr const char* kCollectiveOps[] = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                                 "broadcast",  "send",       "recv"};
/// Ranks of a plan's mesh (1 for a single-device plan).
int64_t mesh_ranks(const Plan& plan);
/// "dp:2,tp:4" ("" for a single-device plan); "R,S(0)" for a placement ("" when not annotated).
std::string mesh_text(const Plan& plan);
std::string placement_text(const std::vector<PlanPlacement>& placement);
/// Bits per element of a Kiln dtype name; 0 when unknown (the runtime does not link the IR).
int dtype_bits(std::string_view name);

/// For `kiln inspect`: a human-readable summary, or JSON ({"format_version", "meta",
/// "targets": ["sm_80", ...], "images": [...], "sections": [...], "inputs", "outputs",
/// "steps": count, "kernels": count, "weights_bytes", "arena_bytes"}).
std::string describe(const Artifact& a, bool json);

}  // namespace kiln::artifact
