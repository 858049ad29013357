/* A plain C host embedding the Kiln runtime: loads a .kiln artifact, fills its inputs from raw
 * files or with a constant, runs it and prints the outputs.
 *
 *   embed MODEL.kiln [--fill VALUE] [--no-graphs] [--repeat N] [INPUT.bin ...]
 *
 * Each INPUT.bin holds one input's raw bytes (row-major, the model's dtype), in input order;
 * inputs without a file are filled with VALUE (default 1). */
#include <kiln/runtime.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char* const kDtypeNames[] = {"f64", "f32", "f16", "bf16", "f8e4m3fn", "f8e5m2", "i64",
                                          "i32", "i16", "i8",  "u8",  "i4",   "bool"};

/* Prints the status's message and releases it; returns 1 on failure. */
static int failed(kiln_status* status, const char* what) {
  if (!status) return 0;
  fprintf(stderr, "embed: %s: %s\n", what, kiln_status_get_message(status));
  kiln_status_release(status);
  return 1;
}

static void print_shape(const kiln_tensor_info* info) {
  printf("%s[", kDtypeNames[info->dtype]);
  for (int32_t d = 0; d < info->rank; ++d) printf(d ? ", %lld" : "%lld", (long long)info->dims[d]);
  printf("]");
}

static uint16_t float_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1); /* round to nearest even */
  return (uint16_t)(u >> 16);
}

static double element(const kiln_tensor_info* info, const unsigned char* p, uint64_t i) {
  switch (info->dtype) {
    case KILN_DTYPE_F64: { double v; memcpy(&v, p + 8 * i, 8); return v; }
    case KILN_DTYPE_F32: { float v; memcpy(&v, p + 4 * i, 4); return v; }
    case KILN_DTYPE_BF16: {
      uint32_t u = (uint32_t)p[2 * i] | (uint32_t)p[2 * i + 1] << 8;
      float v;
      u <<= 16;
      memcpy(&v, &u, 4);
      return v;
    }
    case KILN_DTYPE_I64: { int64_t v; memcpy(&v, p + 8 * i, 8); return (double)v; }
    case KILN_DTYPE_I32: { int32_t v; memcpy(&v, p + 4 * i, 4); return v; }
    case KILN_DTYPE_U8: case KILN_DTYPE_BOOL: return p[i];
    case KILN_DTYPE_I8: return (signed char)p[i];
    default: return 0;
  }
}

/* Fills a tensor with `value` where the dtype is one this example knows; zeros otherwise. */
static void fill(const kiln_tensor_info* info, unsigned char* p, double value) {
  uint64_t count = 1;
  for (int32_t d = 0; d < info->rank; ++d) count *= (uint64_t)info->dims[d];
  memset(p, 0, info->bytes);
  for (uint64_t i = 0; i < count; ++i) {
    switch (info->dtype) {
      case KILN_DTYPE_F64: memcpy(p + 8 * i, &value, 8); break;
      case KILN_DTYPE_F32: { float v = (float)value; memcpy(p + 4 * i, &v, 4); break; }
      case KILN_DTYPE_BF16: { uint16_t v = float_to_bf16((float)value); memcpy(p + 2 * i, &v, 2); break; }
      case KILN_DTYPE_I64: { int64_t v = (int64_t)value; memcpy(p + 8 * i, &v, 8); break; }
      case KILN_DTYPE_I32: { int32_t v = (int32_t)value; memcpy(p + 4 * i, &v, 4); break; }
      case KILN_DTYPE_U8: case KILN_DTYPE_I8: case KILN_DTYPE_BOOL: p[i] = (unsigned char)(int)value; break;
      default: return;
    }
  }
}

static int read_file(const char* path, unsigned char* p, uint64_t bytes) {
  FILE* f = fopen(path, "rb");
  if (!f) {
    fprintf(stderr, "embed: cannot open '%s'\n", path);
    return 1;
  }
  size_t got = fread(p, 1, bytes, f);
  int extra = fgetc(f) != EOF;
  fclose(f);
  if (got != bytes || extra) {
    fprintf(stderr, "embed: '%s' must hold exactly %llu bytes\n", path, (unsigned long long)bytes);
    return 1;
  }
  return 0;
}

int main(int argc, char** argv) {
  const char* model_path = NULL;
  const char* files[64];
  size_t num_files = 0;
  double value = 1;
  int graphs = 1, repeat = 1, rc = 1;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--fill") && i + 1 < argc) value = atof(argv[++i]);
    else if (!strcmp(argv[i], "--no-graphs")) graphs = 0;
    else if (!strcmp(argv[i], "--repeat") && i + 1 < argc) repeat = atoi(argv[++i]);
    else if (!model_path) model_path = argv[i];
    else if (num_files < 64) files[num_files++] = argv[i];
  }
  if (!model_path) {
    fprintf(stderr, "usage: embed MODEL.kiln [--fill VALUE] [--no-graphs] [--repeat N] [INPUT.bin ...]\n");
    return 2;
  }

  /* The function table checks that the runtime is at least as new as this header. */
  if (!kiln_get_api(KILN_RUNTIME_API_VERSION)) {
    fprintf(stderr, "embed: the Kiln runtime is older than API version %d\n", KILN_RUNTIME_API_VERSION);
    return 1;
  }
  kiln_runtime_options options;
  kiln_runtime_options_initialize(&options);
  options.use_cuda_graphs = graphs;
  kiln_runtime* runtime = NULL;
  kiln_model* model = NULL;
  kiln_host_tensor* inputs = NULL;
  kiln_host_tensor* outputs = NULL;
  size_t num_inputs = 0, num_outputs = 0;
  if (failed(kiln_runtime_create(&options, &runtime), "creating the runtime")) return 1;
  if (failed(kiln_model_load_file(runtime, model_path, &model), "loading the model")) goto done;
  printf("model %s on %s\n", model_path, kiln_runtime_device_name(runtime));

  num_inputs = kiln_model_num_inputs(model);
  num_outputs = kiln_model_num_outputs(model);
  inputs = calloc(num_inputs + 1, sizeof *inputs);
  outputs = calloc(num_outputs + 1, sizeof *outputs);
  if (!inputs || !outputs) goto done;
  for (size_t i = 0; i < num_inputs; ++i) {
    kiln_tensor_info info;
    if (failed(kiln_model_input_info(model, i, &info), "input info")) goto done;
    inputs[i].bytes = info.bytes;
    inputs[i].data = malloc(info.bytes ? info.bytes : 1);
    if (!inputs[i].data) goto done;
    if (i < num_files) {
      if (read_file(files[i], inputs[i].data, info.bytes)) goto done;
    } else {
      fill(&info, inputs[i].data, value);
    }
    printf("input  %s: ", info.name);
    print_shape(&info);
    if (i < num_files) printf(" from %s\n", files[i]);
    else printf(" filled with %g\n", value);
  }
  for (size_t i = 0; i < num_outputs; ++i) {
    kiln_tensor_info info;
    if (failed(kiln_model_output_info(model, i, &info), "output info")) goto done;
    outputs[i].bytes = info.bytes;
    outputs[i].data = malloc(info.bytes ? info.bytes : 1);
    if (!outputs[i].data) goto done;
  }

  for (int r = 0; r < repeat; ++r)
    if (failed(kiln_model_run(model, inputs, num_inputs, outputs, num_outputs), "running the model")) goto done;

  for (size_t i = 0; i < num_outputs; ++i) {
    kiln_tensor_info info;
    uint64_t count = 1;
    if (failed(kiln_model_output_info(model, i, &info), "output info")) goto done;
    for (int32_t d = 0; d < info.rank; ++d) count *= (uint64_t)info.dims[d];
    printf("output %s: ", info.name);
    print_shape(&info);
    printf(" =");
    for (uint64_t e = 0; e < count && e < 8; ++e) printf(" %g", element(&info, outputs[i].data, e));
    printf(count > 8 ? " ...\n" : "\n");
  }
  {
    kiln_memory_report report;
    memset(&report, 0, sizeof report);
    report.struct_size = sizeof report;
    if (!failed(kiln_model_memory_report(model, &report), "memory report"))
      printf("device memory: weights %llu, activations %llu, workspace %llu bytes; kiln allocated %llu, "
             "reserved %llu; pinned staging %llu\n",
             (unsigned long long)report.weights, (unsigned long long)report.activations,
             (unsigned long long)report.workspace, (unsigned long long)report.allocated,
             (unsigned long long)report.reserved, (unsigned long long)report.staging);
  }
  rc = 0;

done:
  for (size_t i = 0; inputs && i < num_inputs; ++i) free(inputs[i].data);
  for (size_t i = 0; outputs && i < num_outputs; ++i) free(outputs[i].data);
  free(inputs);
  free(outputs);
  kiln_model_release(model);
  kiln_runtime_release(runtime);
  return rc;
}
