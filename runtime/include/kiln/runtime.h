/* Kiln runtime C API: load a compiled .kiln artifact and run it on a GPU.
 *
 * The runtime has no compiler inside and depends only on the CUDA libraries, so a host
 * program embeds it without the rest of Kiln.
 *
 * Conventions (as ONNX Runtime's OrtApi and IREE's runtime API):
 * - Objects are opaque handles made by kiln_<object>_create/_load and freed by
 *   kiln_<object>_release; release accepts NULL.
 * - Every function that can fail returns a kiln_status*: NULL means success; otherwise the
 *   caller owns the status and frees it with kiln_status_release.
 * - Options structs start with struct_size; fill them with kiln_*_options_initialize first
 *   so that a host built against an older header keeps working with a newer runtime.
 * - Threading: a kiln_runtime may be shared by threads; a kiln_model runs one call at a time
 *   (calls on one model from several threads must be serialized by the host).
 * - kiln_get_api(version) returns a function table that only grows at its end.
 */
#ifndef KILN_RUNTIME_H_
#define KILN_RUNTIME_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(KILN_RUNTIME_BUILD)
#define KILN_RUNTIME_EXPORT __attribute__((visibility("default")))
#else
#define KILN_RUNTIME_EXPORT
#endif

#define KILN_RUNTIME_API_VERSION 7

/* ---- status ------------------------------------------------------------------------------ */

typedef enum kiln_status_code {
  KILN_STATUS_OK = 0,
  KILN_STATUS_INVALID_ARGUMENT = 1,  /* bad input: corrupt artifact, wrong shapes or dtypes */
  KILN_STATUS_NOT_FOUND = 2,         /* missing file, unknown input name */
  KILN_STATUS_UNSUPPORTED = 3,       /* no image for this device, feature not available */
  KILN_STATUS_OUT_OF_MEMORY = 4,     /* device or host allocation failed */
  KILN_STATUS_NO_DEVICE = 5,         /* no usable GPU */
  KILN_STATUS_DEVICE_ERROR = 6,      /* a CUDA, cuBLASLt or driver call failed */
  KILN_STATUS_INTERNAL = 7,
  /* Since API version 5: a collective failed or did not finish within the collective timeout;
   * the model's communicators were aborted and it cannot run again (release it, load anew). */
  KILN_STATUS_COLLECTIVE_FAILED = 8,
} kiln_status_code;

typedef struct kiln_status kiln_status;

KILN_RUNTIME_EXPORT kiln_status_code kiln_status_get_code(const kiln_status* status);
/* The message lives as long as the status. Never NULL for a non-NULL status. */
KILN_RUNTIME_EXPORT const char* kiln_status_get_message(const kiln_status* status);
KILN_RUNTIME_EXPORT void kiln_status_release(kiln_status* status);

/* ---- element types (same order as Kiln's DType) -------------------------------------------- */

typedef enum kiln_dtype {
  KILN_DTYPE_F64 = 0, KILN_DTYPE_F32, KILN_DTYPE_F16, KILN_DTYPE_BF16, KILN_DTYPE_F8E4M3FN,
  KILN_DTYPE_F8E5M2, KILN_DTYPE_I64, KILN_DTYPE_I32, KILN_DTYPE_I16, KILN_DTYPE_I8,
  KILN_DTYPE_U8, KILN_DTYPE_I4, KILN_DTYPE_BOOL,
} kiln_dtype;

#define KILN_MAX_RANK 8

/* Describes one model input or output. Strings are owned by the model. */
typedef struct kiln_tensor_info {
  const char* name;
  kiln_dtype dtype;
  int32_t rank;
  int64_t dims[KILN_MAX_RANK];
  uint64_t bytes; /* storage size of the whole tensor */
} kiln_tensor_info;

/* Host memory the caller owns: data must hold `bytes` bytes (row-major, Kiln's storage layout:
 * i4 packs two per byte, bool one byte of 0 or 1). */
typedef struct kiln_host_tensor {
  void* data;
  uint64_t bytes;
} kiln_host_tensor;

/* ---- runtime ------------------------------------------------------------------------------- */

typedef struct kiln_runtime kiln_runtime;

typedef struct kiln_runtime_options {
  uint32_t struct_size;
  int32_t device_ordinal;       /* default 0 */
  int32_t use_cuda_graphs;      /* default 1: capture the whole plan once, replay it */
  uint64_t device_memory_limit; /* bytes Kiln may hold on the device; 0 = no limit */
  /* Since API version 2. Default 0. When 1, each run brackets the plan's steps with CUDA
   * events (input and output copies stay outside them, and with CUDA graphs on are issued
   * apart from the graph), so kiln_model_device_time reports the device time of the plan.
   * The device first waits 50 us (a one-thread kernel; KILN_TIMING_LEAD_US sets the length,
   * 0 drops it) so the steps start behind running device work rather than behind the host's
   * launch or an input copy. KILN_TIMING_FLUSH_L2=1 also reads twice the L2's size first, so
   * the steps find none of their data in L2 (as for weights too large to stay there). */
  int32_t enable_timing;
} kiln_runtime_options;

KILN_RUNTIME_EXPORT void kiln_runtime_options_initialize(kiln_runtime_options* options);
KILN_RUNTIME_EXPORT kiln_status* kiln_runtime_create(const kiln_runtime_options* options,
                                                     kiln_runtime** out_runtime);
KILN_RUNTIME_EXPORT void kiln_runtime_release(kiln_runtime* runtime);
/* "sm_90" etc. for the runtime's device; owned by the runtime. */
KILN_RUNTIME_EXPORT const char* kiln_runtime_device_name(const kiln_runtime* runtime);

/* ---- models -------------------------------------------------------------------------------- */

typedef struct kiln_model kiln_model;

/* Loads an artifact: validates it, picks the image for the device (matching SASS, else PTX
 * that the driver compiles), uploads the weights, plans memory. Fails with UNSUPPORTED and a
 * message naming the artifact's targets and the device when no image fits. */
KILN_RUNTIME_EXPORT kiln_status* kiln_model_load_file(kiln_runtime* runtime, const char* path,
                                                      kiln_model** out_model);
/* Same from memory; the bytes are copied, the caller may free them after the call. */
KILN_RUNTIME_EXPORT kiln_status* kiln_model_load_memory(kiln_runtime* runtime, const void* data,
                                                        size_t size, kiln_model** out_model);
KILN_RUNTIME_EXPORT void kiln_model_release(kiln_model* model);

KILN_RUNTIME_EXPORT size_t kiln_model_num_inputs(const kiln_model* model);
KILN_RUNTIME_EXPORT size_t kiln_model_num_outputs(const kiln_model* model);
KILN_RUNTIME_EXPORT kiln_status* kiln_model_input_info(const kiln_model* model, size_t index,
                                                       kiln_tensor_info* out_info);
KILN_RUNTIME_EXPORT kiln_status* kiln_model_output_info(const kiln_model* model, size_t index,
                                                        kiln_tensor_info* out_info);

/* Runs the model: copies inputs to the device (through pinned staging), runs the plan (as a
 * CUDA graph replay when enabled), copies outputs back, and waits. Inputs and outputs are in
 * the model's order; each buffer's size must equal the tensor's bytes. */
KILN_RUNTIME_EXPORT kiln_status* kiln_model_run(kiln_model* model, const kiln_host_tensor* inputs,
                                                size_t num_inputs, kiln_host_tensor* outputs,
                                                size_t num_outputs);

/* Since API version 2: kiln_model_run split in two, so a host can overlap its own work with
 * the device's and measure what launching costs. kiln_model_enqueue checks the arguments as
 * kiln_model_run does, copies the inputs into pinned staging (the caller may reuse them when it
 * returns), and launches the input copies, the plan and the output copies without waiting.
 * The outputs are written by kiln_model_synchronize, so their buffers must stay valid until
 * then. Staging is shared by the calls, so an enqueue while a run is pending first completes
 * that run (as kiln_model_synchronize; its failure is returned). kiln_model_synchronize waits
 * for the pending run, copies its outputs and reports faults raised on the device; without a
 * pending run it does nothing. kiln_model_run is enqueue followed by synchronize. */
KILN_RUNTIME_EXPORT kiln_status* kiln_model_enqueue(kiln_model* model, const kiln_host_tensor* inputs,
                                                    size_t num_inputs, kiln_host_tensor* outputs,
                                                    size_t num_outputs);
KILN_RUNTIME_EXPORT kiln_status* kiln_model_synchronize(kiln_model* model);

/* Since API version 2: the device time, in milliseconds, of the plan's steps in the last
 * completed run, input and output copies excluded. UNSUPPORTED unless the runtime was created
 * with enable_timing; INVALID_ARGUMENT before the first completed run. */
KILN_RUNTIME_EXPORT kiln_status* kiln_model_device_time(const kiln_model* model, double* out_ms);

/* Since API version 3: the device time of each plan step, for finding where a model spends
 * its time. Runs the plan's steps `iterations` times without a CUDA graph on the inputs of the
 * last run (zeros before the first), with a CUDA event between every two steps, and writes the
 * mean milliseconds of step i to out_step_ms[i]; `capacity` is out_step_ms's length and must be
 * at least kiln_model_num_steps. Slower than a normal run (one event per step): for profiling,
 * not for timing the whole model. */
KILN_RUNTIME_EXPORT size_t kiln_model_num_steps(const kiln_model* model);
KILN_RUNTIME_EXPORT kiln_status* kiln_model_profile_steps(kiln_model* model, int32_t iterations,
                                                          double* out_step_ms, size_t capacity);

/* Device memory held by Kiln, by category. */
typedef struct kiln_memory_report {
  uint32_t struct_size;
  uint64_t weights;      /* uploaded constants */
  uint64_t activations;  /* the static plan's arena (inputs, outputs, intermediates) */
  uint64_t workspace;    /* library scratch (cuBLASLt) */
  uint64_t staging;      /* pinned host staging (host memory) */
  uint64_t allocated;    /* device bytes in use by Kiln */
  uint64_t reserved;     /* device bytes held by Kiln's caching allocator, in use or not */
} kiln_memory_report;

KILN_RUNTIME_EXPORT kiln_status* kiln_model_memory_report(const kiln_model* model,
                                                          kiln_memory_report* out_report);

/* ---- autotuning (since API version 4) ----------------------------------------------------- */

/* What kiln_model_tune_step found for one plan step. */
typedef struct kiln_tune_result {
  uint32_t struct_size;
  int32_t candidates;   /* algorithms timed; 0 when the step has nothing to tune */
  double best_ms;       /* median device time of the fastest candidate */
  double heuristic_ms;  /* median device time of the library's own first choice */
  /* Plan fields to append to the step's line so the runtime uses the fastest candidate
   * (docs/artifact.md): gemm "algo=<128 hex digits>" (a cublasLtMatmulAlgo_t), conv
   * "algo=<name> algo_math=<name>"; "" when candidates is 0. */
  char choice[256];
} kiln_tune_result;

/* Writes a NUL-terminated descriptor of what plan step `step`'s algorithm choice depends on
 * ("" for a step with nothing to tune: launch, copy, memset): a readable label ("gemm
 * 2048x4096x4096 batch 3 bf16"), then " | " and every field that changes the best choice
 * (shapes, strides, dtypes, transposes, epilogue, pointer alignments, workspace, the device's
 * name and compute capability, the cuBLASLt or cuDNN version). Equal descriptors may share one
 * tuned choice, so hosts use them as cache keys. INVALID_ARGUMENT when `capacity` is too small. */
KILN_RUNTIME_EXPORT kiln_status* kiln_model_step_problem(const kiln_model* model, size_t step, char* out,
                                                         size_t capacity);
/* Times up to `max_candidates` algorithms for step `step` (gemm: cuBLASLt's heuristic list;
 * conv: those cuDNN can run in the plan's workspace), each `iterations` times after a warm-up,
 * on the model's own buffers (it overwrites activations: tune a model loaded for tuning, not
 * one whose results are pending), and reports the fastest by median time. The loaded model
 * keeps its algorithms. A step with nothing to tune gives candidates 0. */
KILN_RUNTIME_EXPORT kiln_status* kiln_model_tune_step(kiln_model* model, size_t step, int32_t max_candidates,
                                                      int32_t iterations, kiln_tune_result* out_result);

/* ---- distributed runs: one process per rank (since API version 5) -------------------------- */

/* A per-rank artifact (docs/artifact.md, "mesh") runs on a device mesh: every rank loads it in
 * its own process on its own GPU, feeds its own piece of each input and gets its own piece of
 * each output; the plan's collective steps run through NCCL on the model's stream, inside the
 * CUDA graph. docs/parallel-runtime.md describes launching and the watchdog. */

#define KILN_MAX_MESH_AXES 8

typedef struct kiln_distributed_options {
  uint32_t struct_size;
  /* Default 1: this process's rank, the world size, its local rank and rank 0's address come
   * from the launcher's environment: torchrun or `kiln launch` (RANK, WORLD_SIZE, LOCAL_RANK,
   * MASTER_ADDR, MASTER_PORT), Open MPI's mpirun (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK),
   * MPICH and Intel MPI (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID), srun (SLURM_PROCID,
   * SLURM_NTASKS, SLURM_LOCALID), the last three with MASTER_ADDR and MASTER_PORT. Without any
   * of them a mesh of one rank runs alone and a larger mesh fails, saying how to launch it.
   * 0: the four fields below. */
  int32_t from_environment;
  int32_t rank;              /* default 0 */
  int32_t world_size;        /* default 1; must equal the number of ranks of the plan's mesh */
  int32_t local_rank;        /* default 0: the rank's index on its host, its CUDA device */
  const char* master_addr;   /* rank 0's host name or address (read during the call); NULL */
  int32_t master_port;       /* rank 0 listens here for the NCCL id hand-off; default 0 */
  /* Default 300. A run whose collectives have not finished this many seconds after it was
   * enqueued, or whose communicator reports an error, aborts the communicators and fails
   * (kiln_model_run, kiln_model_synchronize: COLLECTIVE_FAILED, naming the step). */
  double collective_timeout_s;
  /* Default 300: the longest wait for the other ranks at load (the id hand-off, creating the
   * communicators, the warm-up run). */
  double bootstrap_timeout_s;
} kiln_distributed_options;

KILN_RUNTIME_EXPORT void kiln_distributed_options_initialize(kiln_distributed_options* options);

/* Loads an artifact as one rank of a distributed run (options NULL: the defaults). Every rank
 * calls it at about the same time: rank 0 hands NCCL's unique id to the others over TCP at
 * master_addr:master_port, then NCCL makes the world's communicator and one per mesh axis. The
 * runtime must be on the rank's device (kiln_runtime_options.device_ordinal = local rank, or 0
 * when the process sees one device). Fails clearly when the world size differs from the mesh's
 * ranks, the device is wrong, or a rank does not show up in time. A single-device artifact loads
 * as kiln_model_load_file does, when the world has one rank. */
KILN_RUNTIME_EXPORT kiln_status* kiln_model_load_file_distributed(kiln_runtime* runtime, const char* path,
                                                                  const kiln_distributed_options* options,
                                                                  kiln_model** out_model);
KILN_RUNTIME_EXPORT kiln_status* kiln_model_load_memory_distributed(kiln_runtime* runtime, const void* data,
                                                                    size_t size,
                                                                    const kiln_distributed_options* options,
                                                                    kiln_model** out_model);

/* The model's mesh and this process's place on it. Strings are owned by the model. */
typedef struct kiln_mesh_info {
  uint32_t struct_size;
  int32_t num_axes;                             /* 0 for a single-device model */
  const char* axis_names[KILN_MAX_MESH_AXES];
  int64_t axis_sizes[KILN_MAX_MESH_AXES];
  int64_t coords[KILN_MAX_MESH_AXES];           /* this rank's position on each axis */
  int32_t rank;                                 /* row-major over the axes, the last fastest */
  int32_t world_size;
} kiln_mesh_info;

KILN_RUNTIME_EXPORT kiln_status* kiln_model_mesh_info(const kiln_model* model, kiln_mesh_info* out_info);

typedef enum kiln_placement_kind {
  KILN_PLACEMENT_REPLICATE = 0,    /* every rank of the axis holds the same tensor */
  KILN_PLACEMENT_SHARD = 1,        /* split in equal blocks along shard_dims[axis]: block k on coordinate k */
  KILN_PLACEMENT_PARTIAL_SUM = 2,  /* the whole tensor is the sum of the axis' ranks' tensors */
  KILN_PLACEMENT_PARTIAL_MAX = 3,  /* ... their elementwise max */
} kiln_placement_kind;

/* How this rank's piece of an input or output (kiln_tensor_info: its own dims) lies in the
 * whole tensor, so a host can slice whole inputs and put outputs back together. */
typedef struct kiln_tensor_placement {
  uint32_t struct_size;
  int32_t num_axes;                              /* the mesh's (0: single device) */
  kiln_placement_kind kinds[KILN_MAX_MESH_AXES];
  int32_t shard_dims[KILN_MAX_MESH_AXES];        /* for KILN_PLACEMENT_SHARD */
  int32_t rank;                                  /* the tensor's rank */
  int64_t global_dims[KILN_MAX_RANK];            /* the whole tensor */
  int64_t offsets[KILN_MAX_RANK];                /* where this rank's piece starts in it */
  int32_t partial;                               /* 1 when some axis is partial */
} kiln_tensor_placement;

KILN_RUNTIME_EXPORT kiln_status* kiln_model_input_placement(const kiln_model* model, size_t index,
                                                            kiln_tensor_placement* out_placement);
KILN_RUNTIME_EXPORT kiln_status* kiln_model_output_placement(const kiln_model* model, size_t index,
                                                             kiln_tensor_placement* out_placement);

/* Every rank's `bytes` bytes from `send`, in rank order, into `recv` (world_size * bytes), over
 * the model's world communicator and under its watchdog. A collective: every rank calls it with
 * the same `bytes`. For hosts that put outputs together on one rank. */
KILN_RUNTIME_EXPORT kiln_status* kiln_model_all_gather_host(kiln_model* model, const void* send, uint64_t bytes,
                                                            void* recv);

/* ---- device memory (since API version 6) ----------------------------------------------------- */

/* Device memory the caller owns, on the runtime's device: `bytes` bytes, as kiln_host_tensor. */
typedef struct kiln_device_tensor {
  void* data;
  uint64_t bytes;
} kiln_device_tensor;

/* Runs the model on device buffers, in the order of the caller's CUDA stream `stream` (a
 * cudaStream_t; NULL is the legacy default stream), without host copies and without waiting:
 * the model's stream waits for the work queued on `stream` so far, copies the inputs into the
 * model's buffers (device to device), runs the plan (a CUDA graph of the steps when the runtime
 * uses graphs) and copies the outputs to `outputs`; then `stream` waits for that work. The
 * buffers must stay valid until it has run on `stream` (for PyTorch: tensors on the current
 * stream, as any kernel of theirs). A run pending from kiln_model_enqueue completes first.
 * Per-rank (distributed) models are UNSUPPORTED: they run through kiln_model_run. */
KILN_RUNTIME_EXPORT kiln_status* kiln_model_run_device(kiln_model* model, const kiln_device_tensor* inputs,
                                                       size_t num_inputs, const kiln_device_tensor* outputs,
                                                       size_t num_outputs, void* stream);

/* ---- variables (since API version 7) ------------------------------------------------------- */

/* Persistent state: the graph's variables (a training step's weights and optimizer state), which
 * live in device memory for as long as the model and which each run updates. Indexed in the
 * plan's order; kiln_model_variable_info names each (the string is owned by the model). A read
 * waits for the pending run, then copies the value to `data` (exactly its `bytes`); a write
 * waits for it too and the next run sees the new value (checkpoint save and resume). Like runs,
 * not to be called concurrently on one model.
 * A variable that is a weight's low-precision copy (the plan's copy_of) follows the weight:
 * writing the weight rounds the same values into its bf16/f16 copies; a copy may be written only
 * after its weight (INVALID_ARGUMENT otherwise), and one the runtime cannot refresh (f8) must be,
 * or the next run fails naming it. */
KILN_RUNTIME_EXPORT size_t kiln_model_num_variables(const kiln_model* model);
KILN_RUNTIME_EXPORT kiln_status* kiln_model_variable_info(const kiln_model* model, size_t index,
                                                          kiln_tensor_info* out_info);
KILN_RUNTIME_EXPORT kiln_status* kiln_model_read_variable(kiln_model* model, size_t index, void* data, uint64_t bytes);
KILN_RUNTIME_EXPORT kiln_status* kiln_model_write_variable(kiln_model* model, size_t index, const void* data,
                                                           uint64_t bytes);

/* ---- versioned function table -------------------------------------------------------------- */

typedef struct kiln_api {
  uint32_t version; /* KILN_RUNTIME_API_VERSION of the runtime that filled it */
  kiln_status_code (*status_get_code)(const kiln_status*);
  const char* (*status_get_message)(const kiln_status*);
  void (*status_release)(kiln_status*);
  void (*runtime_options_initialize)(kiln_runtime_options*);
  kiln_status* (*runtime_create)(const kiln_runtime_options*, kiln_runtime**);
  void (*runtime_release)(kiln_runtime*);
  const char* (*runtime_device_name)(const kiln_runtime*);
  kiln_status* (*model_load_file)(kiln_runtime*, const char*, kiln_model**);
  kiln_status* (*model_load_memory)(kiln_runtime*, const void*, size_t, kiln_model**);
  void (*model_release)(kiln_model*);
  size_t (*model_num_inputs)(const kiln_model*);
  size_t (*model_num_outputs)(const kiln_model*);
  kiln_status* (*model_input_info)(const kiln_model*, size_t, kiln_tensor_info*);
  kiln_status* (*model_output_info)(const kiln_model*, size_t, kiln_tensor_info*);
  kiln_status* (*model_run)(kiln_model*, const kiln_host_tensor*, size_t, kiln_host_tensor*, size_t);
  kiln_status* (*model_memory_report)(const kiln_model*, kiln_memory_report*);
  /* version 2 */
  kiln_status* (*model_enqueue)(kiln_model*, const kiln_host_tensor*, size_t, kiln_host_tensor*, size_t);
  kiln_status* (*model_synchronize)(kiln_model*);
  kiln_status* (*model_device_time)(const kiln_model*, double*);
  /* version 3 */
  size_t (*model_num_steps)(const kiln_model*);
  kiln_status* (*model_profile_steps)(kiln_model*, int32_t, double*, size_t);
  /* version 4 */
  kiln_status* (*model_step_problem)(const kiln_model*, size_t, char*, size_t);
  kiln_status* (*model_tune_step)(kiln_model*, size_t, int32_t, int32_t, kiln_tune_result*);
  /* version 5 */
  void (*distributed_options_initialize)(kiln_distributed_options*);
  kiln_status* (*model_load_file_distributed)(kiln_runtime*, const char*, const kiln_distributed_options*,
                                              kiln_model**);
  kiln_status* (*model_load_memory_distributed)(kiln_runtime*, const void*, size_t, const kiln_distributed_options*,
                                                kiln_model**);
  kiln_status* (*model_mesh_info)(const kiln_model*, kiln_mesh_info*);
  kiln_status* (*model_input_placement)(const kiln_model*, size_t, kiln_tensor_placement*);
  kiln_status* (*model_output_placement)(const kiln_model*, size_t, kiln_tensor_placement*);
  kiln_status* (*model_all_gather_host)(kiln_model*, const void*, uint64_t, void*);
  /* version 6 */
  kiln_status* (*model_run_device)(kiln_model*, const kiln_device_tensor*, size_t, const kiln_device_tensor*, size_t,
                                   void*);
  /* version 7 */
  size_t (*model_num_variables)(const kiln_model*);
  kiln_status* (*model_variable_info)(const kiln_model*, size_t, kiln_tensor_info*);
  kiln_status* (*model_read_variable)(kiln_model*, size_t, void*, uint64_t);
  kiln_status* (*model_write_variable)(kiln_model*, size_t, const void*, uint64_t);
  /* New entries go here, at the end, with a bump of KILN_RUNTIME_API_VERSION. */
} kiln_api;

/* The function table for `version` (1 .. KILN_RUNTIME_API_VERSION), or NULL when this runtime
 * is older than the version asked for. */
KILN_RUNTIME_EXPORT const kiln_api* kiln_get_api(uint32_t version);

#ifdef __cplusplus
}
#endif

#endif /* KILN_RUNTIME_H_ */
