// cuDNN conv steps: lazy loading of libcudnn.so.9, descriptors, algorithm search at load, launch.
#include "conv.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

namespace kiln::rt {
namespace {

/// "plan:LINE: conv: MSG", an invalid-argument status.
kiln_status* step_error(int line, const std::string& msg) {
  return make_status(KILN_STATUS_INVALID_ARGUMENT, "plan:" + std::to_string(line) + ": conv: " + msg);
}

kiln_status* cudnn_status(const CudnnApi& api, cudnnStatus_t st, const char* call) {
  if (st == CUDNN_STATUS_SUCCESS) return nullptr;
  std::string name = call;
  name = name.substr(0, name.find('('));
  return make_status(st == CUDNN_STATUS_ALLOC_FAILED ? KILN_STATUS_OUT_OF_MEMORY : KILN_STATUS_DEVICE_ERROR,
                     name + " failed: " + api.cudnnGetErrorString(st));
}

#define KILN_CUDNN_TRY(api, call) KILN_RT_TRY(cudnn_status((api), (call), #call))

/// The step's attributes as numbers; the plan reader has checked their form and ranges.
struct ConvAttrs {
  int n = 0, c = 0, k = 0, groups = 1;
  bool channels_last = false;  // layout=nhwc: x [N, spatial..., C], w [K, kernel..., C/groups]
  std::vector<int> spatial, kernel, pad, stride, dilation;

  static std::vector<int> list(const std::string& v) {
    std::vector<int> out;
    for (size_t at = 0; at <= v.size();) {
      size_t end = v.find(',', at);
      if (end == std::string::npos) end = v.size();
      int d = 0;
      std::from_chars(v.data() + at, v.data() + end, d);
      out.push_back(d);
      at = end + 1;
    }
    return out;
  }
  explicit ConvAttrs(const artifact::PlanStep& s) {
    auto num = [&](const char* key) { return list(s.attrs.at(key)).at(0); };
    n = num("n"), c = num("c"), k = num("k"), groups = num("groups");
    auto layout = s.attrs.find("layout");
    channels_last = layout != s.attrs.end() && layout->second == "nhwc";
    spatial = list(s.attrs.at("spatial")), kernel = list(s.attrs.at("kernel")), pad = list(s.attrs.at("pad"));
    stride = list(s.attrs.at("stride")), dilation = list(s.attrs.at("dilation"));
    // cuDNN wants at least two spatial dims: a 1-D conv is a 2-D one of height 1.
    while (spatial.size() < 2) {
      for (auto* v : {&spatial, &kernel, &stride, &dilation}) v->insert(v->begin(), 1);
      pad.insert(pad.begin(), 0);
    }
  }
  std::vector<int> out_spatial() const {
    std::vector<int> o;
    for (size_t d = 0; d < spatial.size(); ++d)
      o.push_back((spatial[d] + 2 * pad[d] - dilation[d] * (kernel[d] - 1) - 1) / stride[d] + 1);
    return o;
  }
};

/// A packed NC<spatial> descriptor of dims {a, b, spatial...}.
/// An [a, b, spatial...] tensor descriptor; channels last (`layout=nhwc`) lays b innermost, as
/// [a, spatial..., b] in memory, which cuDNN reads from the strides.
kiln_status* tensor_desc(const CudnnApi& api, cudnnTensorDescriptor_t* d, cudnnDataType_t type, int a, int b,
                         const std::vector<int>& spatial, bool channels_last) {
  std::vector<int> dims = {a, b};
  dims.insert(dims.end(), spatial.begin(), spatial.end());
  std::vector<int> strides(dims.size(), 1);
  if (channels_last) {
    int step = b;  // the channel stride is 1; then the spatial dims, innermost last
    for (size_t i = dims.size(); i-- > 2;) strides[i] = step, step *= dims[i];
    strides[0] = step;
  } else {
    for (size_t i = dims.size() - 1; i-- > 0;) strides[i] = strides[i + 1] * dims[i + 1];
  }
  KILN_CUDNN_TRY(api, api.cudnnCreateTensorDescriptor(d));
  KILN_CUDNN_TRY(api, api.cudnnSetTensorNdDescriptor(*d, type, static_cast<int>(dims.size()), dims.data(),
                                                     strides.data()));
  return nullptr;
}

std::string join(const std::vector<int>& v, char sep) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? std::string(1, sep) : "") + std::to_string(v[i]);
  return s;
}

/// Whether `perf` may serve the step: it ran, fits the workspace, and (strict f32) uses
/// neither tensor-core math nor the FFT and Winograd transforms, which lose more than f32 rounding.
bool allowed(const cudnnConvolutionFwdAlgoPerf_t& perf, uint64_t workspace_bytes, bool strict_f32) {
  const cudnnConvolutionFwdAlgo_t al = perf.algo;
  const bool tensor_math = perf.mathType == CUDNN_TENSOR_OP_MATH || perf.mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION;
  const bool transform = al == CUDNN_CONVOLUTION_FWD_ALGO_FFT || al == CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING ||
                         al == CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD || al == CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED;
  return perf.status == CUDNN_STATUS_SUCCESS && perf.memory <= workspace_bytes && !(strict_f32 && (tensor_math || transform));
}

/// Index of `name` in `names`, or -1.
template <size_t N>
int name_index(const char* const (&names)[N], const std::string& name) {
  for (size_t i = 0; i < N; ++i)
    if (name == names[i]) return static_cast<int>(i);
  return -1;
}

}  // namespace

// The plan's names follow cuDNN 9's enum order.
static_assert(CUDNN_CONVOLUTION_FWD_ALGO_COUNT == std::size(artifact::kConvAlgoNames));
static_assert(CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED == 7 && CUDNN_FMA_MATH == 3);

std::string cudnn_library_name() {
  const char* env = std::getenv("KILN_CUDNN_LIBRARY");
  return env && *env ? env : "libcudnn.so.9";
}

const CudnnApi* load_cudnn(std::string* error) {
  static std::mutex mu;
  static std::map<std::string, std::unique_ptr<CudnnApi>> loaded;
  const std::string name = cudnn_library_name();
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = loaded.find(name); it != loaded.end()) return it->second.get();
  void* lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* why = dlerror();
    *error = why ? why : "dlopen failed";
    return nullptr;
  }
  auto api = std::make_unique<CudnnApi>();
#define KILN_CUDNN_RESOLVE(f)                                                 \
  if (void* sym = dlsym(lib, #f)) {                                           \
    std::memcpy(&api->f, &sym, sizeof sym);                                   \
  } else {                                                                    \
    *error = name + " has no function " #f;                                   \
    dlclose(lib);                                                             \
    return nullptr;                                                           \
  }
  KILN_CUDNN_FUNCTIONS(KILN_CUDNN_RESOLVE)
#undef KILN_CUDNN_RESOLVE
  api->version = api->cudnnGetVersion();
  if (api->version / 10000 != 9) {
    *error = name + " is cuDNN " + std::to_string(api->version / 10000) + "." +
             std::to_string(api->version / 100 % 100) + ", the runtime needs major version 9";
    dlclose(lib);
    return nullptr;
  }
  return (loaded[name] = std::move(api)).get();
}

CudnnContext::~CudnnContext() {
  if (handle_) api_->cudnnDestroy(handle_);
}

kiln_status* CudnnContext::create(const artifact::PlanStep& step, cudaStream_t stream,
                                  std::unique_ptr<CudnnContext>* out) {
  std::string error;
  const CudnnApi* api = load_cudnn(&error);
  if (!api)
    return make_status(KILN_STATUS_UNSUPPORTED, "plan:" + std::to_string(step.line) + ": conv needs cuDNN 9 (" +
                                                    cudnn_library_name() + "): " + error);
  auto ctx = std::unique_ptr<CudnnContext>(new CudnnContext());
  ctx->api_ = api;
  KILN_CUDNN_TRY(*api, api->cudnnCreate(&ctx->handle_));
  KILN_CUDNN_TRY(*api, api->cudnnSetStream(ctx->handle_, stream));
  *out = std::move(ctx);
  return nullptr;
}

ConvStep::~ConvStep() {
  if (!cudnn_) return;
  const CudnnApi& api = cudnn_->api();
  for (cudnnTensorDescriptor_t d : {x_desc_, y_desc_, bias_desc_})
    if (d) api.cudnnDestroyTensorDescriptor(d);
  if (w_desc_) api.cudnnDestroyFilterDescriptor(w_desc_);
  if (conv_desc_) api.cudnnDestroyConvolutionDescriptor(conv_desc_);
  if (act_desc_) api.cudnnDestroyActivationDescriptor(act_desc_);
}

kiln_status* ConvStep::create(const artifact::PlanStep& step,
                              const std::function<const DeviceBuffer*(int)>& buffer_of,
                              const CudnnContext& cudnn, void* workspace, uint64_t workspace_bytes,
                              std::unique_ptr<ConvStep>* out) {
  const CudnnApi& api = cudnn.api();
  const ConvAttrs a(step);
  const std::string& dt = step.attrs.at("dtype");
  const bool tf32 = step.attrs.at("math") == "tf32";
  const cudnnDataType_t type = dt == "f32" ? CUDNN_DATA_FLOAT : dt == "f16" ? CUDNN_DATA_HALF : CUDNN_DATA_BFLOAT16;
  auto g = std::unique_ptr<ConvStep>(new ConvStep());
  g->cudnn_ = &cudnn;
  g->line_ = step.line;
  g->relu_ = step.attrs.at("activation") == "relu";
  auto pointer = [&](const char* key, bool required, const void** p) -> kiln_status* {
    auto it = step.attrs.find(key);
    if (it == step.attrs.end()) return required ? step_error(step.line, std::string("missing ") + key + "=") : nullptr;
    int id = -1;
    std::from_chars(it->second.data() + 1, it->second.data() + it->second.size(), id);
    const DeviceBuffer* b = buffer_of(id);
    if (!b) return step_error(step.line, std::string(key) + " refers to undefined buffer " + it->second);
    *p = b->ptr;
    return nullptr;
  };
  const void* y = nullptr;
  KILN_RT_TRY(pointer("x", true, &g->x_));
  KILN_RT_TRY(pointer("w", true, &g->w_));
  KILN_RT_TRY(pointer("y", true, &y));
  KILN_RT_TRY(pointer("z", false, &g->z_));
  KILN_RT_TRY(pointer("bias", false, &g->bias_));
  g->y_ = const_cast<void*>(y);

  const std::vector<int> out_sp = a.out_spatial(), ones(a.spatial.size(), 1);
  KILN_RT_TRY(tensor_desc(api, &g->x_desc_, type, a.n, a.c, a.spatial, a.channels_last));
  KILN_RT_TRY(tensor_desc(api, &g->y_desc_, type, a.n, a.k, out_sp, a.channels_last));
  KILN_RT_TRY(tensor_desc(api, &g->bias_desc_, type, 1, a.k, ones, false));
  std::vector<int> wdims = {a.k, a.c / a.groups};
  wdims.insert(wdims.end(), a.kernel.begin(), a.kernel.end());
  KILN_CUDNN_TRY(api, api.cudnnCreateFilterDescriptor(&g->w_desc_));
  KILN_CUDNN_TRY(api, api.cudnnSetFilterNdDescriptor(g->w_desc_, type, a.channels_last ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW,
                                                     static_cast<int>(wdims.size()), wdims.data()));
  KILN_CUDNN_TRY(api, api.cudnnCreateConvolutionDescriptor(&g->conv_desc_));
  // Accumulate in f32 for every dtype, as the reference does.
  KILN_CUDNN_TRY(api, api.cudnnSetConvolutionNdDescriptor(g->conv_desc_, static_cast<int>(a.spatial.size()),
                                                          a.pad.data(), a.stride.data(), a.dilation.data(),
                                                          CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
  KILN_CUDNN_TRY(api, api.cudnnSetConvolutionGroupCount(g->conv_desc_, a.groups));
  // As PyTorch: FMA keeps f32 in f32 (cuDNN's default math may pick TF32 on Ampere and later),
  // default math lets f32 use TF32 tensor cores, and half types use tensor cores.
  const cudnnMathType_t math = type != CUDNN_DATA_FLOAT ? CUDNN_TENSOR_OP_MATH : tf32 ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH;
  KILN_CUDNN_TRY(api, api.cudnnSetConvolutionMathType(g->conv_desc_, math));
  KILN_CUDNN_TRY(api, api.cudnnCreateActivationDescriptor(&g->act_desc_));
  KILN_CUDNN_TRY(api, api.cudnnSetActivationDescriptor(g->act_desc_, CUDNN_ACTIVATION_RELU, CUDNN_NOT_PROPAGATE_NAN, 0.0));

  const bool strict = type == CUDNN_DATA_FLOAT && !tf32;
  g->strict_f32_ = strict;
  g->problem_ = "conv " + std::to_string(a.n) + "x" + std::to_string(a.c) + "x" + join(a.spatial, 'x') + " -> " +
                std::to_string(a.k) + " " + join(a.kernel, 'x') + " stride " + join(a.stride, ',') + " " + dt +
                (tf32 ? " tf32" : "") + " | n=" + std::to_string(a.n) + " c=" + std::to_string(a.c) + " k=" +
                std::to_string(a.k) + " spatial=" + join(a.spatial, ',') + " kernel=" + join(a.kernel, ',') +
                " pad=" + join(a.pad, ',') + " stride=" + join(a.stride, ',') + " dilation=" + join(a.dilation, ',') +
                " groups=" + std::to_string(a.groups) + (a.channels_last ? " layout=nhwc" : "") + " dtype=" + dt +
                " math=" + (tf32 ? "tf32" : "f32") + " bias=" + (g->bias_ ? "1" : "0") + " z=" + (g->z_ ? "1" : "0") + " relu=" + (g->relu_ ? "1" : "0") +
                " workspace=" + std::to_string(workspace_bytes);
  bool chosen = false;
  if (auto it = step.attrs.find("algo"); it != step.attrs.end()) {
    // The reader has checked the names (and that strict f32 names no tensor math or transform).
    const auto algo = static_cast<cudnnConvolutionFwdAlgo_t>(name_index(artifact::kConvAlgoNames, it->second));
    const auto tuned_math = static_cast<cudnnMathType_t>(name_index(artifact::kConvMathNames, step.attrs.at("algo_math")));
    KILN_CUDNN_TRY(api, api.cudnnSetConvolutionMathType(g->conv_desc_, strict ? CUDNN_FMA_MATH : tuned_math));
    size_t need = 0;
    const cudnnStatus_t st = api.cudnnGetConvolutionForwardWorkspaceSize(cudnn.handle(), g->x_desc_, g->w_desc_,
                                                                         g->conv_desc_, g->y_desc_, algo, &need);
    if (st == CUDNN_STATUS_SUCCESS && need <= workspace_bytes) {
      g->algo_ = algo;
      g->math_ = strict ? CUDNN_FMA_MATH : tuned_math;
      chosen = g->from_plan_ = true;
    } else {
      static std::atomic<bool> noted{false};
      if (!noted.exchange(true))
        std::fprintf(stderr, "kiln: note: plan:%d: conv: the tuned algo=%s does not fit this GPU and cuDNN (%s); "
                     "searching for one at load (noted once)\n", step.line, it->second.c_str(),
                     st != CUDNN_STATUS_SUCCESS ? api.cudnnGetErrorString(st)
                                                : ("needs " + format_bytes(need) + " of workspace").c_str());
      KILN_CUDNN_TRY(api, api.cudnnSetConvolutionMathType(g->conv_desc_, math));
    }
  }
  if (!chosen) {
    // Time the candidates once on the real buffers; y is overwritten, nothing reads it yet.
    cudnnConvolutionFwdAlgoPerf_t perf[CUDNN_CONVOLUTION_FWD_ALGO_COUNT];
    int found = 0;
    KILN_CUDNN_TRY(api, api.cudnnFindConvolutionForwardAlgorithmEx(
                            cudnn.handle(), g->x_desc_, g->x_, g->w_desc_, g->w_, g->conv_desc_, g->y_desc_, g->y_,
                            CUDNN_CONVOLUTION_FWD_ALGO_COUNT, &found, perf, workspace, workspace_bytes));
    const cudnnConvolutionFwdAlgoPerf_t* best = nullptr;
    for (int i = 0; i < found && !best; ++i)
      if (allowed(perf[i], workspace_bytes, strict)) best = &perf[i];
    if (!best)
      return make_status(KILN_STATUS_UNSUPPORTED,
                         "plan:" + std::to_string(step.line) + ": conv: cuDNN has no algorithm for this " + dt +
                             " conv within the " + format_bytes(workspace_bytes) + " workspace");
    g->algo_ = best->algo;
    // Strict f32 stays on FMA whatever the search reports; otherwise keep the math it timed.
    g->math_ = strict ? CUDNN_FMA_MATH : best->mathType;
    KILN_CUDNN_TRY(api, api.cudnnSetConvolutionMathType(g->conv_desc_, g->math_));
  }
  // The fused call applies relu and takes a bias; cuDNN checks the combination when called,
  // so try it once here and keep separate calls when it refuses.
  if (g->relu_ && g->bias_) {
    g->fused_ = true;
    if (kiln_status* st = g->enqueue(true, workspace, workspace_bytes)) {
      kiln_status_release(st);
      g->fused_ = false;
    }
  }
  *out = std::move(g);
  return nullptr;
}

kiln_status* ConvStep::enqueue(bool fused, void* workspace, uint64_t workspace_bytes) const {
  const CudnnApi& api = cudnn_->api();
  cudnnHandle_t h = cudnn_->handle();
  const float one = 1, zero = 0;
  if (fused) {
    // z is read with weight alpha2 = 0 when absent (cuDNN still wants a descriptor and pointer).
    const float alpha2 = z_ ? 1.0f : 0.0f;
    KILN_CUDNN_TRY(api, api.cudnnConvolutionBiasActivationForward(
                            h, &one, x_desc_, x_, w_desc_, w_, conv_desc_, algo_, workspace, workspace_bytes,
                            &alpha2, y_desc_, z_ ? z_ : y_, bias_desc_, bias_, act_desc_, y_desc_, y_));
    return nullptr;
  }
  KILN_CUDNN_TRY(api, api.cudnnConvolutionForward(h, &one, x_desc_, x_, w_desc_, w_, conv_desc_, algo_, workspace,
                                                  workspace_bytes, &zero, y_desc_, y_));
  if (z_) KILN_CUDNN_TRY(api, api.cudnnAddTensor(h, &one, y_desc_, z_, &one, y_desc_, y_));
  if (bias_) KILN_CUDNN_TRY(api, api.cudnnAddTensor(h, &one, bias_desc_, bias_, &one, y_desc_, y_));
  if (relu_) KILN_CUDNN_TRY(api, api.cudnnActivationForward(h, act_desc_, &one, y_desc_, y_, &zero, y_desc_, y_));
  return nullptr;
}

kiln_status* ConvStep::use_algorithm(std::pair<cudnnConvolutionFwdAlgo_t, cudnnMathType_t> choice) {
  const CudnnApi& api = cudnn_->api();
  algo_ = choice.first, math_ = choice.second;
  KILN_CUDNN_TRY(api, api.cudnnSetConvolutionMathType(conv_desc_, math_));
  return nullptr;
}

kiln_status* ConvStep::time_candidates(void* workspace, uint64_t workspace_bytes, cudaStream_t stream,
                                       int max_candidates, int iterations, TuneOutcome* out, bool keep) {
  const CudnnApi& api = cudnn_->api();
  *out = {};
  cudnnConvolutionFwdAlgoPerf_t perf[CUDNN_CONVOLUTION_FWD_ALGO_COUNT];
  int found = 0;
  KILN_CUDNN_TRY(api, api.cudnnFindConvolutionForwardAlgorithmEx(
                          cudnn_->handle(), x_desc_, x_, w_desc_, w_, conv_desc_, y_desc_, y_,
                          CUDNN_CONVOLUTION_FWD_ALGO_COUNT, &found, perf, workspace, workspace_bytes));
  cudnnConvolutionFwdAlgo_t own_algo = algo_;
  cudnnMathType_t own_math = math_;
  double best = 0;
  bool first = true;
  for (int i = 0; i < found && out->candidates < std::max(max_candidates, 1); ++i) {
    if (!allowed(perf[i], workspace_bytes, strict_f32_)) continue;
    algo_ = perf[i].algo;
    math_ = strict_f32_ ? CUDNN_FMA_MATH : perf[i].mathType;
    double ms = 0;
    kiln_status* st = cudnn_status(api, api.cudnnSetConvolutionMathType(conv_desc_, math_), "cudnnSetConvolutionMathType");
    // Timed as run() enqueues it (fused or not); a candidate that cannot run that way is skipped.
    if (!st) st = median_launch_ms(stream, iterations, [&] { return enqueue(fused_, workspace, workspace_bytes); }, &ms);
    if (st) {
      kiln_status_release(st);
      (void)cudaStreamSynchronize(stream);
      (void)cudaGetLastError();
      continue;
    }
    if (first) out->heuristic_ms = ms, first = false;  // cuDNN's own fastest: the load-time choice
    if (out->candidates++ == 0 || ms < best) {
      best = ms;
      out->choice = std::string("algo=") + artifact::kConvAlgoNames[algo_] + " algo_math=" + artifact::kConvMathNames[math_];
      if (keep) own_algo = algo_, own_math = math_;
    }
  }
  out->best_ms = best;
  algo_ = own_algo, math_ = own_math;
  KILN_CUDNN_TRY(api, api.cudnnSetConvolutionMathType(conv_desc_, math_));
  return nullptr;
}

kiln_status* ConvStep::run(void* workspace, uint64_t workspace_bytes) const {
  if (kiln_status* st = enqueue(fused_, workspace, workspace_bytes)) {
    st->message = "plan:" + std::to_string(line_) + ": conv: " + st->message;
    return st;
  }
  return nullptr;
}

}  // namespace kiln::rt
