#include "worker/cpu/dot.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <thread>

#include <algorithm>
#include <vector>

#include "core/dtype.h"
#include "worker/cpu/layout.h"
#include "worker/cpu/traits.h"

namespace tessel::cpu {

namespace {
std::atomic<int> kernel_threads{0};
}  // namespace

void SetKernelThreads(int n) {
  n = std::max(1, n);
  kernel_threads.store(n);
  openblas_set_num_threads(n);
}

int KernelThreads() {
  const int n = kernel_threads.load();
  return n > 0 ? n : std::max(1, int(std::thread::hardware_concurrency()));
}

DotOperandLayout CanonicalizeDotOperand(const v1::TensorType& t,
                                        const google::protobuf::RepeatedField<int64_t>& batch,
                                        const google::protobuf::RepeatedField<int64_t>& contracting,
                                        bool free_first) {
  DotOperandLayout c;
  std::vector<int64_t> free;
  for (int64_t i = 0; i < t.dims_size(); ++i) {
    if (std::find(batch.begin(), batch.end(), i) == batch.end() &&
        std::find(contracting.begin(), contracting.end(), i) == contracting.end()) {
      free.push_back(i);
    }
  }
  for (int64_t d : batch) {
    c.perm.push_back(d);
    c.batch *= t.dims(d);
  }
  int64_t nfree = 1, ncon = 1;
  for (int64_t d : free) nfree *= t.dims(d);
  for (int64_t d : contracting) ncon *= t.dims(d);
  const auto& first =
      free_first ? free : std::vector<int64_t>(contracting.begin(), contracting.end());
  const auto& second =
      free_first ? std::vector<int64_t>(contracting.begin(), contracting.end()) : free;
  c.perm.insert(c.perm.end(), first.begin(), first.end());
  c.perm.insert(c.perm.end(), second.begin(), second.end());
  c.rows = free_first ? nfree : ncon;
  c.cols = free_first ? ncon : nfree;
  return c;
}

bool IsIdentityPermutation(const std::vector<int64_t>& p) {
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] != int64_t(i)) return false;
  }
  return true;
}

namespace {
// Returns a pointer to the operand laid out as perm says, copying into
// `scratch` only if needed.
const void* Materialize(const v1::TensorType& t, const void* data, const std::vector<int64_t>& perm,
                        std::vector<char>& scratch) {
  if (IsIdentityPermutation(perm)) return data;
  v1::TransposeAttrs ta;
  v1::TensorType out;
  out.set_dtype(t.dtype());
  for (int64_t p : perm) {
    ta.add_permutation(p);
    out.add_dims(t.dims(p));
  }
  scratch.resize(ByteSizeUnchecked(t));
  Transpose(t, data, ta, out, scratch.data());
  return scratch.data();
}
}  // namespace

bool IsTransposedLayout(const DotOperandLayout& c, size_t nbatch, size_t nrow_dims) {
  std::vector<int64_t> swapped(c.perm.begin(), c.perm.begin() + nbatch);
  swapped.insert(swapped.end(), c.perm.begin() + nbatch + nrow_dims, c.perm.end());
  swapped.insert(swapped.end(), c.perm.begin() + nbatch, c.perm.begin() + nbatch + nrow_dims);
  return IsIdentityPermutation(swapped);
}

namespace {

template <v1::DType D>
void NaiveGemm(int64_t batch, int64_t m, int64_t n, int64_t k, const void* a_v, const void* b_v,
               void* c_v) {
  using T = Traits<D>;
  using C = typename T::C;
  using A = std::conditional_t<kIsFloat<C>, C, uint64_t>;
  const auto* a = static_cast<const typename T::S*>(a_v);
  const auto* b = static_cast<const typename T::S*>(b_v);
  auto* c = static_cast<typename T::S*>(c_v);
  std::vector<A> row(n);
  for (int64_t bi = 0; bi < batch; ++bi) {
    for (int64_t i = 0; i < m; ++i) {
      std::fill(row.begin(), row.end(), A(0));
      for (int64_t p = 0; p < k; ++p) {
        A av = A(T::Load(a[(bi * m + i) * k + p]));
        const auto* brow = b + (bi * k + p) * n;
        for (int64_t j = 0; j < n; ++j) row[j] += av * A(T::Load(brow[j]));
      }
      for (int64_t j = 0; j < n; ++j) c[(bi * m + i) * n + j] = T::Store(C(row[j]));
    }
  }
}

}  // namespace

void DotGeneral(const v1::TensorType& lt, const void* lhs, const v1::TensorType& rt,
                const void* rhs, const v1::DotGeneralAttrs& a, const v1::TensorType& out_type,
                void* out) {
  DotOperandLayout l =
      CanonicalizeDotOperand(lt, a.lhs_batch(), a.lhs_contracting(), /*free_first=*/true);
  DotOperandLayout r =
      CanonicalizeDotOperand(rt, a.rhs_batch(), a.rhs_contracting(), /*free_first=*/false);
  const int64_t batch = l.batch, m = l.rows, k = l.cols, n = r.cols;
  const v1::DType dt = lt.dtype();
  const int esize = DTypeSize(dt);
  if (m == 0 || n == 0 || batch == 0) return;
  if (k == 0) {
    std::fill_n(static_cast<char*>(out), ByteSizeUnchecked(out_type), 0);
    return;
  }
  std::vector<char> lscratch, rscratch;
  if (dt == v1::F32 || dt == v1::F64) {
    const size_t nb = a.lhs_batch_size();
    const size_t l_free_dims = lt.dims_size() - nb - a.lhs_contracting_size();
    const size_t r_con_dims = a.rhs_contracting_size();
    bool lt_trans = !IsIdentityPermutation(l.perm) && IsTransposedLayout(l, nb, l_free_dims);
    bool rt_trans = !IsIdentityPermutation(r.perm) && IsTransposedLayout(r, nb, r_con_dims);
    const char* lp =
        static_cast<const char*>(lt_trans ? lhs : Materialize(lt, lhs, l.perm, lscratch));
    const char* rp =
        static_cast<const char*>(rt_trans ? rhs : Materialize(rt, rhs, r.perm, rscratch));
    const auto ta = lt_trans ? CblasTrans : CblasNoTrans;
    const auto tb = rt_trans ? CblasTrans : CblasNoTrans;
    const int64_t lda = lt_trans ? m : k, ldb = rt_trans ? k : n;
    char* op = static_cast<char*>(out);
    for (int64_t bi = 0; bi < batch; ++bi) {
      const char* ap = lp + bi * m * k * esize;
      const char* bp = rp + bi * k * n * esize;
      char* cp = op + bi * m * n * esize;
      if (dt == v1::F32) {
        cblas_sgemm(CblasRowMajor, ta, tb, m, n, k, 1.0f, reinterpret_cast<const float*>(ap), lda,
                    reinterpret_cast<const float*>(bp), ldb, 0.0f, reinterpret_cast<float*>(cp), n);
      } else {
        cblas_dgemm(CblasRowMajor, ta, tb, m, n, k, 1.0, reinterpret_cast<const double*>(ap), lda,
                    reinterpret_cast<const double*>(bp), ldb, 0.0, reinterpret_cast<double*>(cp),
                    n);
      }
    }
    return;
  }
  const void* lp = Materialize(lt, lhs, l.perm, lscratch);
  const void* rp = Materialize(rt, rhs, r.perm, rscratch);
  TESSEL_DISPATCH(dt, D, {
    if constexpr (D != v1::PRED) NaiveGemm<D>(batch, m, n, k, lp, rp, out);
  });
}

}  // namespace tessel::cpu
