// The cpu backend's LLVM side: elementwise groups to LLVM IR loops, O3 with the loop
// vectorizer and glibc's vector math library, object code through the kernel cache, ORC LLJIT.
#include <dlfcn.h>

#include <cmath>
#include <limits>
#include <map>
#include <mutex>

#include <llvm/Analysis/TargetLibraryInfo.h>
#include <llvm/ExecutionEngine/Orc/ExecutionUtils.h>
#include <llvm/ExecutionEngine/Orc/LLJIT.h>
#include <llvm/IR/IRBuilder.h>
#include <llvm/IR/Intrinsics.h>
#include <llvm/IR/LLVMContext.h>
#include <llvm/IR/LegacyPassManager.h>
#include <llvm/IR/Module.h>
#include <llvm/IR/Verifier.h>
#include <llvm/MC/TargetRegistry.h>
#include <llvm/Passes/PassBuilder.h>
#include <llvm/Support/MemoryBuffer.h>
#include <llvm/Support/TargetSelect.h>
#include <llvm/Support/raw_ostream.h>
#include <llvm/Target/TargetMachine.h>
#include <llvm/TargetParser/Host.h>

#include "cpu.h"
#include "kiln/core/kernel_cache.h"
#include "kiln/ir/op.h"

namespace kiln::cpu {
namespace {

using llvm::IRBuilder;
using LV = llvm::Value;

/// Version of what this file emits; part of every cache key.
constexpr const char* kProducer = "cpu@0.1.0";

void init_llvm() {
  static std::once_flag once;
  std::call_once(once, [] {
    llvm::InitializeNativeTarget();
    llvm::InitializeNativeTargetAsmPrinter();
    // The vectorized math calls (_ZGVdN8v_expf ...) resolve from glibc's libmvec.
    dlopen("libmvec.so.1", RTLD_NOW | RTLD_GLOBAL);
  });
}

std::string host_cpu_name() { return llvm::sys::getHostCPUName().str(); }

std::string host_features() {
  std::string out;
  for (const auto& f : llvm::sys::getHostCPUFeatures()) {
    if (!out.empty()) out += ',';
    out += (f.second ? "+" : "-") + f.first().str();
  }
  return out;
}

/// The LLVM type an element is stored as (bf16 as its bits); null when not lowered.
llvm::Type* storage_type(llvm::LLVMContext& c, DType t) {
  switch (t) {
    case DType::kF64: return llvm::Type::getDoubleTy(c);
    case DType::kF32: return llvm::Type::getFloatTy(c);
    case DType::kF16: return llvm::Type::getHalfTy(c);
    case DType::kBF16: return llvm::Type::getInt16Ty(c);
    case DType::kI64: return llvm::Type::getInt64Ty(c);
    case DType::kI32: return llvm::Type::getInt32Ty(c);
    case DType::kI16: return llvm::Type::getInt16Ty(c);
    case DType::kI8:
    case DType::kU8:
    case DType::kBool: return llvm::Type::getInt8Ty(c);
    default: return nullptr;
  }
}

/// The type values are computed in: f16/bf16 widen to f32, bool is i1.
llvm::Type* compute_type(llvm::LLVMContext& c, DType t) {
  if (t == DType::kF16 || t == DType::kBF16) return llvm::Type::getFloatTy(c);
  if (t == DType::kBool) return llvm::Type::getInt1Ty(c);
  return storage_type(c, t);
}

bool is_unsigned(DType t) { return t == DType::kU8 || t == DType::kBool; }

/// Emits one group's function. Holds the builder and the per-element value map.
class GroupEmitter {
 public:
  GroupEmitter(llvm::Module& m, const std::string& cpu, const std::string& features)
      : m_(m), c_(m.getContext()), b_(c_), cpu_(cpu), features_(features) {}

  bool emit(ElemGroup& g, std::string* why);

 private:
  llvm::Type* i64() { return b_.getInt64Ty(); }
  LV* ci(int64_t v) { return b_.getInt64(static_cast<uint64_t>(v)); }
  LV* cf(llvm::Type* t, double v) { return llvm::ConstantFP::get(t, v); }
  bool fail(std::string* why, const std::string& w) {
    *why = w;
    return false;
  }

  LV* load(DType t, LV* ptr);
  void store(DType t, LV* v, LV* ptr);
  LV* round_to(DType t, LV* v);
  LV* to_bf16_bits(LV* f);
  LV* libm(const char* fname, LV* x);
  LV* exp(LV* x) { return b_.CreateUnaryIntrinsic(llvm::Intrinsic::exp, x); }
  LV* tanh(LV* x);
  LV* erf(LV* x);
  LV* cast(LV* v, DType from, DType to);
  /// The value of node `n` at the current element, or null when it has no lowering.
  LV* op(const Node& n, const std::vector<LV*>& a, std::string* why);
  template <typename Body>
  void loop(LV* begin, LV* end, Body body);

  llvm::Module& m_;
  llvm::LLVMContext& c_;
  IRBuilder<> b_;
  std::string cpu_, features_;
};

LV* GroupEmitter::load(DType t, LV* ptr) {
  LV* v = b_.CreateLoad(storage_type(c_, t), ptr);
  switch (t) {
    case DType::kF16: return b_.CreateFPExt(v, b_.getFloatTy());
    case DType::kBF16:
      return b_.CreateBitCast(b_.CreateShl(b_.CreateZExt(v, b_.getInt32Ty()), 16), b_.getFloatTy());
    case DType::kBool: return b_.CreateICmpNE(v, b_.getInt8(0));
    default: return v;
  }
}

LV* GroupEmitter::to_bf16_bits(LV* f) {
  // Round to nearest even on the bits; nan becomes the quiet nan 0x7fc0.
  LV* bits = b_.CreateBitCast(f, b_.getInt32Ty());
  LV* lsb = b_.CreateAnd(b_.CreateLShr(bits, 16), b_.getInt32(1));
  LV* rounded = b_.CreateLShr(b_.CreateAdd(bits, b_.CreateAdd(lsb, b_.getInt32(0x7fff))), 16);
  LV* nan = b_.CreateFCmpUNO(f, f);
  return b_.CreateTrunc(b_.CreateSelect(nan, b_.getInt32(0x7fc0), rounded), b_.getInt16Ty());
}

void GroupEmitter::store(DType t, LV* v, LV* ptr) {
  switch (t) {
    case DType::kF16: v = b_.CreateFPTrunc(v, b_.getHalfTy()); break;
    case DType::kBF16: v = to_bf16_bits(v); break;
    case DType::kBool: v = b_.CreateZExt(v, b_.getInt8Ty()); break;
    default: break;
  }
  b_.CreateStore(v, ptr);
}

LV* GroupEmitter::round_to(DType t, LV* v) {
  if (t == DType::kF16) return b_.CreateFPExt(b_.CreateFPTrunc(v, b_.getHalfTy()), b_.getFloatTy());
  if (t == DType::kBF16)
    return b_.CreateBitCast(b_.CreateShl(b_.CreateZExt(to_bf16_bits(v), b_.getInt32Ty()), 16),
                            b_.getFloatTy());
  return v;
}

LV* GroupEmitter::libm(const char* fname, LV* x) {
  const bool f32 = x->getType()->isFloatTy();
  const std::string name = std::string(fname) + (f32 ? "f" : "");
  llvm::FunctionCallee fn = m_.getOrInsertFunction(name, x->getType(), x->getType());
  if (auto* f = llvm::dyn_cast<llvm::Function>(fn.getCallee())) {
    f->setDoesNotAccessMemory();
    f->setDoesNotThrow();
    f->addFnAttr(llvm::Attribute::WillReturn);
  }
  return b_.CreateCall(fn, {x});
}

LV* GroupEmitter::tanh(LV* x) {
  if (!x->getType()->isFloatTy()) return libm("tanh", x);
  // f32: through exp so that the loop vectorizes (libmvec has no tanhf); small |x| by its
  // series, where 1 - 2/(e^2x + 1) would cancel.
  llvm::Type* t = x->getType();
  LV* ax = b_.CreateUnaryIntrinsic(llvm::Intrinsic::fabs, x);
  LV* e = exp(b_.CreateFMul(ax, cf(t, 2.0)));
  LV* big = b_.CreateFSub(cf(t, 1.0), b_.CreateFDiv(cf(t, 2.0), b_.CreateFAdd(e, cf(t, 1.0))));
  big = b_.CreateBinaryIntrinsic(llvm::Intrinsic::copysign, big, x);
  LV* x2 = b_.CreateFMul(x, x);
  LV* poly = b_.CreateFAdd(cf(t, -1.0 / 3.0), b_.CreateFMul(x2, cf(t, 2.0 / 15.0)));
  LV* small = b_.CreateFAdd(x, b_.CreateFMul(x, b_.CreateFMul(x2, poly)));
  return b_.CreateSelect(b_.CreateFCmpOLT(ax, cf(t, 0.0625)), small, big);
}

LV* GroupEmitter::erf(LV* x) {
  if (!x->getType()->isFloatTy()) return libm("erf", x);
  // f32: Abramowitz and Stegun 7.1.26 (absolute error below 1.5e-7), vectorizable.
  llvm::Type* t = x->getType();
  LV* ax = b_.CreateUnaryIntrinsic(llvm::Intrinsic::fabs, x);
  LV* k = b_.CreateFDiv(cf(t, 1.0), b_.CreateFAdd(cf(t, 1.0), b_.CreateFMul(ax, cf(t, 0.3275911))));
  LV* p = cf(t, 1.061405429);
  for (double a : {-1.453152027, 1.421413741, -0.284496736, 0.254829592})
    p = b_.CreateFAdd(b_.CreateFMul(p, k), cf(t, a));
  p = b_.CreateFMul(p, k);
  LV* y = b_.CreateFSub(cf(t, 1.0), b_.CreateFMul(p, exp(b_.CreateFNeg(b_.CreateFMul(ax, ax)))));
  return b_.CreateBinaryIntrinsic(llvm::Intrinsic::copysign, y, x);
}

LV* GroupEmitter::cast(LV* v, DType from, DType to) {
  llvm::Type* tt = compute_type(c_, to);
  if (to == DType::kBool)
    return is_float(from) ? b_.CreateFCmpUNE(v, cf(v->getType(), 0.0))
                          : b_.CreateICmpNE(v, llvm::ConstantInt::get(v->getType(), 0));
  if (is_integer(to)) {
    if (is_float(from)) {
      // trunc toward zero, nan to 0, saturating at int64's range, then wrapping to the width.
      LV* w = b_.CreateIntrinsic(llvm::Intrinsic::fptosi_sat, {i64(), v->getType()}, {v});
      return b_.CreateTrunc(w, tt);
    }
    return b_.CreateIntCast(v, tt, !is_unsigned(from));
  }
  LV* f;
  if (is_float(from))
    f = b_.CreateFPCast(v, tt);
  else
    f = is_unsigned(from) ? b_.CreateUIToFP(v, tt) : b_.CreateSIToFP(v, tt);
  return round_to(to, f);
}

LV* GroupEmitter::op(const Node& n, const std::vector<LV*>& a, std::string* why) {
  const std::string& o = n.op_name();
  const DType in = n.num_operands() > 0 ? n.operand(n.num_operands() - 1)->dtype() : DType::kF32;
  const bool fl = is_float(in);
  const bool uns = is_unsigned(in);
  llvm::Type* t = a.empty() ? nullptr : a.back()->getType();
  auto un = [&](llvm::Intrinsic::ID id) { return b_.CreateUnaryIntrinsic(id, a[0]); };
  auto sigmoid = [&](LV* x) {
    return b_.CreateFDiv(cf(t, 1.0), b_.CreateFAdd(cf(t, 1.0), exp(b_.CreateFNeg(x))));
  };
  auto zero = [&] { return llvm::Constant::getNullValue(t); };

  if (o == "identity") return a[0];
  if (o == "cast") return cast(a[0], n.operand(0)->dtype(), n.result()->dtype());
  if (o == "where") return b_.CreateSelect(a[0], a[1], a[2]);
  if (o == "not") return b_.CreateNot(a[0]);
  if (o == "and") return b_.CreateAnd(a[0], a[1]);
  if (o == "or") return b_.CreateOr(a[0], a[1]);
  if (o == "xor") return b_.CreateXor(a[0], a[1]);
  if (o == "equal") return fl ? b_.CreateFCmpOEQ(a[0], a[1]) : b_.CreateICmpEQ(a[0], a[1]);
  if (o == "not_equal") return fl ? b_.CreateFCmpUNE(a[0], a[1]) : b_.CreateICmpNE(a[0], a[1]);
  if (o == "less")
    return fl ? b_.CreateFCmpOLT(a[0], a[1]) : uns ? b_.CreateICmpULT(a[0], a[1]) : b_.CreateICmpSLT(a[0], a[1]);
  if (o == "less_equal")
    return fl ? b_.CreateFCmpOLE(a[0], a[1]) : uns ? b_.CreateICmpULE(a[0], a[1]) : b_.CreateICmpSLE(a[0], a[1]);
  if (o == "greater")
    return fl ? b_.CreateFCmpOGT(a[0], a[1]) : uns ? b_.CreateICmpUGT(a[0], a[1]) : b_.CreateICmpSGT(a[0], a[1]);
  if (o == "greater_equal")
    return fl ? b_.CreateFCmpOGE(a[0], a[1]) : uns ? b_.CreateICmpUGE(a[0], a[1]) : b_.CreateICmpSGE(a[0], a[1]);

  if (!fl) {
    if (in == DType::kBool) return nullptr;
    if (o == "add") return b_.CreateAdd(a[0], a[1]);
    if (o == "sub") return b_.CreateSub(a[0], a[1]);
    if (o == "mul") return b_.CreateMul(a[0], a[1]);
    if (o == "neg") return b_.CreateNeg(a[0]);
    if (o == "abs") return b_.CreateSelect(b_.CreateICmpSLT(a[0], zero()), b_.CreateNeg(a[0]), a[0]);
    if (o == "relu") return b_.CreateSelect(b_.CreateICmpSLT(a[0], zero()), zero(), a[0]);
    if (o == "sign")
      return b_.CreateSub(b_.CreateZExt(b_.CreateICmpSGT(a[0], zero()), t),
                          b_.CreateZExt(b_.CreateICmpSLT(a[0], zero()), t));
    if (o == "maximum")
      return b_.CreateBinaryIntrinsic(uns ? llvm::Intrinsic::umax : llvm::Intrinsic::smax, a[0], a[1]);
    if (o == "minimum")
      return b_.CreateBinaryIntrinsic(uns ? llvm::Intrinsic::umin : llvm::Intrinsic::smin, a[0], a[1]);
    if (o == "clip") {
      // The integers inside [min, max], clamped to what the dtype holds (as the reference).
      // Compared as doubles before converting: i64's largest value is no double (2^63 - 1
      // rounds to 2^63, which does not convert back).
      const int bits = dtype_bits(in);
      const int64_t tmin = uns ? 0 : bits == 64 ? std::numeric_limits<int64_t>::min() : -(int64_t{1} << (bits - 1));
      const int64_t tmax = uns ? (int64_t{1} << bits) - 1
                               : bits == 64 ? std::numeric_limits<int64_t>::max() : (int64_t{1} << (bits - 1)) - 1;
      auto bound = [&](double v) -> int64_t {
        if (v <= static_cast<double>(tmin)) return tmin;
        if (v >= static_cast<double>(tmax)) return tmax;
        return static_cast<int64_t>(v);
      };
      const auto ilo = static_cast<uint64_t>(n.has_attr("min") ? bound(std::ceil(n.get_float("min"))) : tmin);
      const auto ihi = static_cast<uint64_t>(n.has_attr("max") ? bound(std::floor(n.get_float("max"))) : tmax);
      LV* v = b_.CreateBinaryIntrinsic(uns ? llvm::Intrinsic::umax : llvm::Intrinsic::smax, a[0],
                                       llvm::ConstantInt::get(t, ilo));
      return b_.CreateBinaryIntrinsic(uns ? llvm::Intrinsic::umin : llvm::Intrinsic::smin, v,
                                      llvm::ConstantInt::get(t, ihi));
    }
    *why = "no integer lowering of '" + o + "'";
    return nullptr;
  }

  if (o == "add") return b_.CreateFAdd(a[0], a[1]);
  if (o == "sub") return b_.CreateFSub(a[0], a[1]);
  if (o == "mul") return b_.CreateFMul(a[0], a[1]);
  if (o == "div") return b_.CreateFDiv(a[0], a[1]);
  if (o == "pow") {
    // A small integer exponent (GELU's x³) is a product: powf is a call per element, and
    // the product stays within a couple of ulps for any finite or special x.
    if (const auto* e = llvm::dyn_cast<llvm::ConstantFP>(a[1])) {
      const double ev = e->getValueAPF().convertToDouble();
      if (ev == 1.0) return a[0];
      if (ev == 2.0) return b_.CreateFMul(a[0], a[0]);
      if (ev == 3.0) return b_.CreateFMul(b_.CreateFMul(a[0], a[0]), a[0]);
      if (ev == 4.0) {
        LV* sq = b_.CreateFMul(a[0], a[0]);
        return b_.CreateFMul(sq, sq);
      }
    }
    return b_.CreateBinaryIntrinsic(llvm::Intrinsic::pow, a[0], a[1]);
  }
  if (o == "maximum") return b_.CreateBinaryIntrinsic(llvm::Intrinsic::maximum, a[0], a[1]);
  if (o == "minimum") return b_.CreateBinaryIntrinsic(llvm::Intrinsic::minimum, a[0], a[1]);
  if (o == "mod") {
    LV* r = b_.CreateFRem(a[0], a[1]);
    if (n.get_int("fmod") != 0) return r;
    // Python's %: the divisor's sign, and a zero result takes it too.
    LV* z = b_.CreateBinaryIntrinsic(llvm::Intrinsic::copysign, zero(), a[1]);
    LV* flip = b_.CreateXor(b_.CreateFCmpOLT(r, zero()), b_.CreateFCmpOLT(a[1], zero()));
    LV* v = b_.CreateSelect(flip, b_.CreateFAdd(r, a[1]), r);
    return b_.CreateSelect(b_.CreateFCmpOEQ(r, zero()), z, v);
  }
  if (o == "neg") return b_.CreateFNeg(a[0]);
  if (o == "abs") return un(llvm::Intrinsic::fabs);
  if (o == "exp") return exp(a[0]);
  if (o == "log") return un(llvm::Intrinsic::log);
  if (o == "sqrt") return un(llvm::Intrinsic::sqrt);
  if (o == "rsqrt") return b_.CreateFDiv(cf(t, 1.0), un(llvm::Intrinsic::sqrt));
  if (o == "reciprocal") return b_.CreateFDiv(cf(t, 1.0), a[0]);
  if (o == "tanh") return tanh(a[0]);
  if (o == "erf") return erf(a[0]);
  if (o == "sigmoid") return sigmoid(a[0]);
  if (o == "relu") return b_.CreateSelect(b_.CreateFCmpOLT(a[0], zero()), zero(), a[0]);
  if (o == "silu") return b_.CreateFMul(a[0], sigmoid(a[0]));
  if (o == "sin") return un(llvm::Intrinsic::sin);
  if (o == "cos") return un(llvm::Intrinsic::cos);
  if (o == "floor") return un(llvm::Intrinsic::floor);
  if (o == "ceil") return un(llvm::Intrinsic::ceil);
  if (o == "round") return un(llvm::Intrinsic::roundeven);
  if (o == "sign") {
    LV* neg = b_.CreateSelect(b_.CreateFCmpOLT(a[0], zero()), cf(t, -1.0), a[0]);
    return b_.CreateSelect(b_.CreateFCmpOGT(a[0], zero()), cf(t, 1.0), neg);
  }
  if (o == "softplus") {
    LV* ax = un(llvm::Intrinsic::fabs);
    return b_.CreateFAdd(b_.CreateBinaryIntrinsic(llvm::Intrinsic::maxnum, a[0], zero()),
                         libm("log1p", exp(b_.CreateFNeg(ax))));
  }
  if (o == "isnan") return b_.CreateFCmpUNO(a[0], a[0]);
  if (o == "isinf")
    return b_.CreateFCmpOEQ(un(llvm::Intrinsic::fabs), cf(t, std::numeric_limits<double>::infinity()));
  if (o == "leaky_relu")
    return b_.CreateSelect(b_.CreateFCmpOLT(a[0], zero()),
                           b_.CreateFMul(a[0], cf(t, n.get_float("alpha"))), a[0]);
  if (o == "gelu") {
    LV* x = a[0];
    LV* inner;
    if (n.get_string("approximate") == "tanh") {
      LV* x3 = b_.CreateFMul(x, b_.CreateFMul(x, x));
      LV* arg = b_.CreateFMul(cf(t, std::sqrt(2.0 / M_PI)), b_.CreateFAdd(x, b_.CreateFMul(cf(t, 0.044715), x3)));
      inner = tanh(arg);
    } else {
      inner = erf(b_.CreateFMul(x, cf(t, M_SQRT1_2)));
    }
    return b_.CreateFMul(b_.CreateFMul(cf(t, 0.5), x), b_.CreateFAdd(cf(t, 1.0), inner));
  }
  if (o == "clip") {
    LV* v = a[0];
    if (n.has_attr("min")) {
      LV* lo = cf(t, n.get_float("min"));
      v = b_.CreateSelect(b_.CreateFCmpOLT(v, lo), lo, v);
    }
    if (n.has_attr("max")) {
      LV* hi = cf(t, n.get_float("max"));
      v = b_.CreateSelect(b_.CreateFCmpOGT(v, hi), hi, v);
    }
    return v;
  }
  *why = "no lowering of '" + o + "'";
  return nullptr;
}

template <typename Body>
void GroupEmitter::loop(LV* begin, LV* end, Body body) {
  llvm::Function* f = b_.GetInsertBlock()->getParent();
  llvm::BasicBlock* pre = b_.GetInsertBlock();
  llvm::BasicBlock* head = llvm::BasicBlock::Create(c_, "head", f);
  llvm::BasicBlock* bb = llvm::BasicBlock::Create(c_, "body", f);
  llvm::BasicBlock* exit = llvm::BasicBlock::Create(c_, "exit", f);
  b_.CreateBr(head);
  b_.SetInsertPoint(head);
  llvm::PHINode* iv = b_.CreatePHI(i64(), 2);
  iv->addIncoming(begin, pre);
  b_.CreateCondBr(b_.CreateICmpSLT(iv, end), bb, exit);
  b_.SetInsertPoint(bb);
  body(iv);
  iv->addIncoming(b_.CreateAdd(iv, ci(1), "", true, true), b_.GetInsertBlock());
  b_.CreateBr(head);
  b_.SetInsertPoint(exit);
}

/// Collapses the broadcast iteration space: drops size-1 dims and merges neighbours that every
/// operand walks contiguously. Strides are in elements (0 for a broadcast dim).
void collapse(Sizes& dims, std::vector<Sizes>& strides) {
  Sizes d2;
  std::vector<Sizes> s2(strides.size());
  for (size_t d = 0; d < dims.size(); ++d) {
    if (dims[d] == 1) continue;
    bool merge = !d2.empty();
    for (size_t k = 0; merge && k < strides.size(); ++k)
      merge = s2[k].back() == strides[k][d] * dims[d];
    if (merge) {
      d2.back() *= dims[d];
      for (size_t k = 0; k < strides.size(); ++k) s2[k].back() = strides[k][d];
    } else {
      d2.push_back(dims[d]);
      for (size_t k = 0; k < strides.size(); ++k) s2[k].push_back(strides[k][d]);
    }
  }
  if (d2.empty()) {
    d2 = {1};
    for (Sizes& s : s2) s = {0};
  }
  dims = std::move(d2);
  strides = std::move(s2);
}

bool GroupEmitter::emit(ElemGroup& g, std::string* why) {
  for (DType t : g.in_dtypes)
    if (!storage_type(c_, t)) return fail(why, "dtype " + std::string(dtype_name(t)) + " is not lowered");
  for (DType t : g.out_dtypes)
    if (!storage_type(c_, t)) return fail(why, "dtype " + std::string(dtype_name(t)) + " is not lowered");
  // The nodes to evaluate per element and where their operands come from.
  std::vector<const Node*> nodes;
  std::vector<const Value*> ins, outs;
  if (g.body) {
    for (const auto& n : g.body->nodes()) nodes.push_back(n.get());
    for (const Value* v : g.body->inputs()) ins.push_back(v);
    outs = std::vector<const Value*>(g.body->outputs().begin(), g.body->outputs().end());
  } else {
    nodes = {g.node};
    ins = std::vector<const Value*>(g.node->operands().begin(), g.node->operands().end());
    for (int i = 0; i < g.node->num_results(); ++i) outs.push_back(g.node->result(i));
  }
  for (const Node* n : nodes) {
    if (n->num_regions() > 0 || n->num_results() != 1) return fail(why, "'" + n->op_name() + "' is not elementwise");
    if (n->op_name() == "constant") {
      const Attribute* v = n->attr("value");
      if (!v || v->kind() != AttrKind::kTensor || v->as_tensor().numel() != 1 ||
          !storage_type(c_, v->as_tensor().dtype()))
        return fail(why, "non-scalar constant in a fused group");
      continue;
    }
    if (!n->op()->has(kTraitElementwise) && n->op_name() != "identity")
      return fail(why, "'" + n->op_name() + "' is not elementwise");
    for (const Value* v : n->operands())
      if (!storage_type(c_, v->dtype())) return fail(why, "dtype " + std::string(dtype_name(v->dtype())) + " is not lowered");
    if (!storage_type(c_, n->result()->dtype())) return fail(why, "dtype is not lowered");
  }

  // Iteration space: the output shape; each input broadcasts into it.
  const size_t rank = g.out_shape.size();
  Sizes dims = rank == 0 ? Sizes{1} : g.out_shape;
  std::vector<Sizes> strides;
  for (const Sizes& s : g.in_shapes) {
    if (s.size() > rank) return fail(why, "operand rank exceeds the result's");
    Sizes st(dims.size(), 0);
    int64_t acc = 1;
    for (size_t d = s.size(); d-- > 0;) {
      const size_t od = dims.size() - s.size() + d;
      if (s[d] != 1 && s[d] != dims[od]) return fail(why, "operand does not broadcast to the result");
      st[od] = s[d] == 1 ? 0 : acc;
      acc *= s[d];
    }
    strides.push_back(st);
  }
  {
    Sizes out_st(dims.size());
    int64_t acc = 1;
    for (size_t d = dims.size(); d-- > 0;) out_st[d] = acc, acc *= dims[d];
    strides.push_back(out_st);
  }
  collapse(dims, strides);
  strides.pop_back();  // the output's: always contiguous
  // Too few rows to share among threads: split the inner dim.
  const int64_t cols0 = dims.back();
  const int64_t rows0 = cols0 == 0 ? 0 : [&] { int64_t p = 1; for (int64_t d : dims) p *= d; return p / cols0; }();
  if (rows0 < 4 * g.threads && cols0 >= 8192) {
    int64_t f = 1;
    for (int64_t cand = 4 * g.threads; cand >= 2; --cand)
      if (cols0 % cand == 0 && cols0 / cand >= 1024) {
        f = cand;
        break;
      }
    if (f > 1) {
      dims.back() = f;
      dims.push_back(cols0 / f);
      for (Sizes& s : strides) {
        const int64_t in = s.back();
        s.back() = in * (cols0 / f);
        s.push_back(in);
      }
    }
  }
  g.cols = dims.back();
  g.rows = g.cols == 0 ? 0 : [&] { int64_t p = 1; for (int64_t d : dims) p *= d; return p / g.cols; }();

  // inner(noalias ptrs..., rb, re) holds the loops; the exported wrapper unpacks bufs.
  const size_t nin = g.in_dtypes.size(), nout = g.out_dtypes.size();
  std::vector<llvm::Type*> params(nin + nout, b_.getPtrTy());
  params.push_back(i64());
  params.push_back(i64());
  auto* ity = llvm::FunctionType::get(b_.getVoidTy(), params, false);
  auto* inner = llvm::Function::Create(ity, llvm::Function::InternalLinkage, g.name + ".inner", m_);
  for (size_t i = 0; i < nin + nout; ++i) inner->addParamAttr(static_cast<unsigned>(i), llvm::Attribute::NoAlias);
  auto* wty = llvm::FunctionType::get(b_.getVoidTy(), {b_.getPtrTy(), i64(), i64()}, false);
  auto* wrap = llvm::Function::Create(wty, llvm::Function::ExternalLinkage, g.name, m_);
  for (llvm::Function* f : {inner, wrap}) {
    f->addFnAttr("target-cpu", cpu_);
    f->addFnAttr("target-features", features_);
    f->addFnAttr(llvm::Attribute::NoUnwind);
  }
  auto cleanup = [&] {
    wrap->eraseFromParent();
    inner->eraseFromParent();
  };

  b_.SetInsertPoint(llvm::BasicBlock::Create(c_, "entry", inner));
  std::vector<LV*> args;
  for (auto& arg : inner->args()) args.push_back(&arg);
  LV* rb = args[nin + nout];
  LV* re = args[nin + nout + 1];
  bool ok = true;
  loop(rb, re, [&](LV* r) {
    // Row base offsets: decompose r over the outer dims.
    std::vector<LV*> base(nin, ci(0));
    LV* rem = r;
    for (size_t d = dims.size() - 1; d-- > 0;) {
      LV* idx = d == 0 ? rem : b_.CreateURem(rem, ci(dims[d]));
      if (d > 0) rem = b_.CreateUDiv(rem, ci(dims[d]));
      for (size_t k = 0; k < nin; ++k)
        if (strides[k][d] != 0) base[k] = b_.CreateAdd(base[k], b_.CreateMul(idx, ci(strides[k][d])));
    }
    LV* out_base = b_.CreateMul(r, ci(g.cols));
    loop(ci(0), ci(g.cols), [&](LV* c) {
      std::map<const Value*, LV*> val;
      for (size_t k = 0; k < nin; ++k) {
        LV* off = strides[k].back() == 0 ? base[k]
                                         : b_.CreateAdd(base[k], b_.CreateMul(c, ci(strides[k].back())));
        val[ins[k]] = load(g.in_dtypes[k], b_.CreateGEP(storage_type(c_, g.in_dtypes[k]), args[k], off));
      }
      for (const Node* n : nodes) {
        if (!ok) return;
        if (n->op_name() == "constant") {
          const Tensor& tv = n->attr("value")->as_tensor();
          const DType dt = n->result()->dtype();
          llvm::Type* ct = compute_type(c_, dt);
          val[n->result()] = is_float(dt) ? static_cast<LV*>(cf(ct, tv.get_f64(0)))
                                          : llvm::ConstantInt::get(ct, static_cast<uint64_t>(tv.get_i64(0)));
          if (is_float(dt)) val[n->result()] = round_to(dt, val[n->result()]);
          continue;
        }
        std::vector<LV*> a;
        for (const Value* v : n->operands()) {
          auto it = val.find(v);
          if (it == val.end()) {
            ok = fail(why, "operand of '" + n->op_name() + "' is not in the group");
            return;
          }
          a.push_back(it->second);
        }
        LV* y = op(*n, a, why);
        if (!y) {
          ok = false;
          return;
        }
        val[n->result()] = round_to(n->result()->dtype(), y);
      }
      LV* oi = b_.CreateAdd(out_base, c);
      for (size_t k = 0; k < nout; ++k) {
        auto it = val.find(outs[k]);
        if (it == val.end()) {
          ok = fail(why, "a group result is not computed in the group");
          return;
        }
        store(g.out_dtypes[k], it->second, b_.CreateGEP(storage_type(c_, g.out_dtypes[k]), args[nin + k], oi));
      }
    });
  });
  if (!ok) {
    cleanup();
    return false;
  }
  b_.CreateRetVoid();

  b_.SetInsertPoint(llvm::BasicBlock::Create(c_, "entry", wrap));
  std::vector<LV*> call_args;
  for (size_t i = 0; i < nin + nout; ++i)
    call_args.push_back(b_.CreateLoad(b_.getPtrTy(), b_.CreateConstGEP1_64(b_.getPtrTy(), wrap->getArg(0), i)));
  call_args.push_back(wrap->getArg(1));
  call_args.push_back(wrap->getArg(2));
  b_.CreateCall(inner, call_args);
  b_.CreateRetVoid();
  std::string err;
  llvm::raw_string_ostream es(err);
  if (llvm::verifyFunction(*inner, &es) || llvm::verifyFunction(*wrap, &es)) {
    cleanup();
    return fail(why, "llvm verifier: " + err);
  }
  return true;
}

std::string take_error(llvm::Error e) { return llvm::toString(std::move(e)); }

}  // namespace

std::string host_cpu_description() { return host_cpu_name() + " " + host_features(); }

struct JitModule::Impl {
  std::unique_ptr<llvm::LLVMContext> ctx = std::make_unique<llvm::LLVMContext>();
  std::unique_ptr<llvm::Module> mod;
  std::unique_ptr<llvm::orc::LLJIT> jit;
  std::map<std::string, ElemFn> fns;
  std::vector<std::string> names;
  std::string cpu, features, ir;
  bool hit = false;
};

JitModule::JitModule() : impl_(std::make_unique<Impl>()) {
  init_llvm();
  impl_->mod = std::make_unique<llvm::Module>("kiln-cpu", *impl_->ctx);
  impl_->cpu = host_cpu_name();
  impl_->features = host_features();
}

JitModule::~JitModule() = default;

bool JitModule::add_group(ElemGroup& g, std::string* why) {
  GroupEmitter e(*impl_->mod, impl_->cpu, impl_->features);
  if (!e.emit(g, why)) return false;
  impl_->names.push_back(g.name);
  return true;
}

int JitModule::num_functions() const { return static_cast<int>(impl_->names.size()); }
bool JitModule::cache_hit() const { return impl_->hit; }
const std::string& JitModule::ir_text() const { return impl_->ir; }

ElemFn JitModule::lookup(const std::string& name) const {
  auto it = impl_->fns.find(name);
  return it == impl_->fns.end() ? nullptr : it->second;
}

Status JitModule::finish() {
  Impl& s = *impl_;
  if (s.names.empty()) return ok_status();
  const std::string triple = llvm::sys::getProcessTriple();
  std::string err;
  const llvm::Target* target = llvm::TargetRegistry::lookupTarget(triple, err);
  if (!target) return internal_error("cpu: no llvm target for " + triple + ": " + err);
  std::unique_ptr<llvm::TargetMachine> tm(target->createTargetMachine(
      triple, s.cpu, s.features, llvm::TargetOptions(), llvm::Reloc::PIC_, std::nullopt,
      llvm::CodeGenOptLevel::Aggressive));
  s.mod->setTargetTriple(triple);
  s.mod->setDataLayout(tm->createDataLayout());
  {
    llvm::raw_string_ostream os(s.ir);
    s.mod->print(os, nullptr);
  }
  KernelCacheKey key{s.ir, s.cpu + " " + s.features, std::string("llvm ") + KILN_LLVM_VERSION,
                     {"O3", "veclib=libmvec-x86", "reloc=pic"}, kProducer};
  KernelCache cache;
  std::optional<std::string> obj = cache.lookup(key);
  s.hit = obj.has_value();
  if (!obj) {
    llvm::Triple tt(triple);
    llvm::TargetLibraryInfoImpl tlii(tt);
    tlii.addVectorizableFunctionsFromVecLib(llvm::TargetLibraryInfoImpl::LIBMVEC_X86, tt);
    llvm::LoopAnalysisManager lam;
    llvm::FunctionAnalysisManager fam;
    llvm::CGSCCAnalysisManager cgam;
    llvm::ModuleAnalysisManager mam;
    llvm::PipelineTuningOptions pto;
    pto.LoopVectorization = true;
    pto.SLPVectorization = true;
    llvm::PassBuilder pb(tm.get(), pto);
    fam.registerPass([&] { return llvm::TargetLibraryAnalysis(tlii); });
    pb.registerModuleAnalyses(mam);
    pb.registerCGSCCAnalyses(cgam);
    pb.registerFunctionAnalyses(fam);
    pb.registerLoopAnalyses(lam);
    pb.crossRegisterProxies(lam, fam, cgam, mam);
    llvm::ModulePassManager mpm = pb.buildPerModuleDefaultPipeline(llvm::OptimizationLevel::O3);
    mpm.run(*s.mod, mam);
    llvm::SmallVector<char, 0> buf;
    llvm::raw_svector_ostream os(buf);
    llvm::legacy::PassManager pm;
    pm.add(new llvm::TargetLibraryInfoWrapperPass(tlii));
    if (tm->addPassesToEmitFile(pm, os, nullptr, llvm::CodeGenFileType::ObjectFile))
      return internal_error("cpu: llvm cannot emit object code for " + triple);
    pm.run(*s.mod);
    obj = std::string(buf.begin(), buf.end());
    // A cache that cannot be written costs the next run a compile, nothing more.
    (void)cache.store(key, *obj);
  }

  auto jit = llvm::orc::LLJITBuilder().create();
  if (!jit) return internal_error("cpu: cannot start the llvm jit: " + take_error(jit.takeError()));
  s.jit = std::move(*jit);
  auto gen = llvm::orc::DynamicLibrarySearchGenerator::GetForCurrentProcess(
      s.jit->getDataLayout().getGlobalPrefix());
  if (!gen) return internal_error("cpu: " + take_error(gen.takeError()));
  s.jit->getMainJITDylib().addGenerator(std::move(*gen));
  if (llvm::Error e = s.jit->addObjectFile(llvm::MemoryBuffer::getMemBufferCopy(*obj, "kiln-cpu.o")))
    return internal_error("cpu: cannot load the compiled kernels: " + take_error(std::move(e)));
  for (const std::string& n : s.names) {
    auto sym = s.jit->lookup(n);
    if (!sym) return internal_error("cpu: kernel " + n + " did not link: " + take_error(sym.takeError()));
    s.fns[n] = sym->toPtr<ElemFn>();
  }
  // The module and its context are no longer needed once the object is loaded.
  s.mod.reset();
  return ok_status();
}

}  // namespace kiln::cpu
