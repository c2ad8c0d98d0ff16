#include "worker/cpu/convolution.h"

#include <dnnl.hpp>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "core/dtype.h"
#include "core/shape_inference.h"
#include "worker/cpu/dot.h"
#include "worker/cpu/layout.h"
#include "worker/cpu/traits.h"

// Debian's oneDNN runs on OpenMP (libgomp): its threads per call.
extern "C" void omp_set_num_threads(int n);

namespace tessel::cpu {
namespace {

using Dims = std::vector<int64_t>;

int64_t Product(const Dims& d) {
  int64_t n = 1;
  for (int64_t x : d) n *= x;
  return n;
}

template <v1::DType D>
void Direct(const v1::TensorType& lt, const void* lhs_v, const v1::TensorType& rt,
            const void* rhs_v, const v1::ConvolutionAttrs& a, const v1::TensorType& ot,
            void* out_v) {
  using T = Traits<D>;
  using C = typename T::C;
  using A = std::conditional_t<kIsFloat<C> || kIsBool<C>, C, uint64_t>;
  const auto* lhs = static_cast<const typename T::S*>(lhs_v);
  const auto* rhs = static_cast<const typename T::S*>(rhs_v);
  auto* out = static_cast<typename T::S*>(out_v);
  const ConvolutionSpecs ord = ConvolutionSpecsOf(a);
  const int s = a.input_spatial_dimensions_size();
  const Dims ls = RowMajorStrides(lt.dims()), rs = RowMajorStrides(rt.dims());
  Dims od(ord.out.size()), lext(s), kext(s);
  for (size_t k = 0; k < ord.out.size(); ++k) od[k] = ot.dims(ord.out[k]);
  for (int i = 0; i < s; ++i) {
    lext[i] = lt.dims(ord.lhs[2 + i]);
    kext[i] = rt.dims(ord.rhs[2 + i]);
  }
  const Dims os = RowMajorStrides(ot.dims());
  const int64_t in_features = rt.dims(a.kernel_input_feature_dimension());
  const int64_t out_features = od[1];
  const int64_t per_fg = out_features / a.feature_group_count();
  const int64_t per_bg = out_features / a.batch_group_count();
  const int64_t out_batch = od[0];
  const int64_t window = Product(kext);
  Dims idx(od.size(), 0), k(s);
  const int64_t total = Product(od);
  for (int64_t e = 0; e < total; ++e) {
    // idx: (batch, feature, spatial...) of this output element, row-major
    // over that order.
    int64_t rem = e;
    for (int j = int(od.size()) - 1; j >= 0; --j) {
      idx[j] = rem % od[j];
      rem /= od[j];
    }
    const int64_t o = idx[1];
    const int64_t n = (o / per_bg) * out_batch + idx[0];
    const int64_t c0 = (o / per_fg) * in_features;
    A acc = A(0);
    for (int64_t w = 0; w < window; ++w) {
      int64_t wr = w, l_off = n * ls[ord.lhs[0]], r_off = o * rs[ord.rhs[0]];
      bool inside = true;
      for (int j = s - 1; j >= 0; --j) {
        k[j] = wr % kext[j];
        wr /= kext[j];
        const int64_t p =
            idx[2 + j] * a.window_strides(j) - a.padding_low(j) + k[j] * a.rhs_dilation(j);
        if (p < 0 || p % a.lhs_dilation(j) != 0 || p / a.lhs_dilation(j) >= lext[j]) {
          inside = false;
          break;
        }
        l_off += p / a.lhs_dilation(j) * ls[ord.lhs[2 + j]];
        r_off += k[j] * rs[ord.rhs[2 + j]];
      }
      if (!inside) continue;
      for (int64_t i = 0; i < in_features; ++i) {
        const A x = A(T::Load(lhs[l_off + (c0 + i) * ls[ord.lhs[1]]]));
        const A y = A(T::Load(rhs[r_off + i * rs[ord.rhs[1]]]));
        if constexpr (kIsBool<C>) {
          acc = acc || (x && y);
        } else {
          acc += x * y;
        }
      }
    }
    int64_t at = 0;
    for (size_t j = 0; j < od.size(); ++j) at += idx[j] * os[ord.out[j]];
    out[at] = T::Store(C(acc));
  }
}

// A float tensor as oneDNN sees it: its dimensions in a convolution's
// order and the strides (in elements) of its own layout, so that no
// operand is copied into that order first.
struct View {
  Dims dims, strides;
  float* data = nullptr;
};

View ViewOf(const v1::TensorType& t, const void* data, const Dims& order) {
  const Dims rs = RowMajorStrides(t.dims());
  View v;
  for (int64_t d : order) {
    v.dims.push_back(t.dims(d));
    v.strides.push_back(rs[d]);
  }
  v.data = static_cast<float*>(const_cast<void*>(data));
  return v;
}

// Weights [O, I, S...] as oneDNN's grouped [G, O/G, I, S...].
View Grouped(View w, int64_t groups) {
  if (groups == 1) return w;
  w.dims[0] /= groups;
  w.dims.insert(w.dims.begin(), groups);
  w.strides.insert(w.strides.begin(), w.dims[1] * w.strides[0]);
  return w;
}

// Block `g` of `blocks` along dimension `d`.
View Block(View v, int d, int64_t g, int64_t blocks) {
  v.dims[d] /= blocks;
  v.data += g * v.dims[d] * v.strides[d];
  return v;
}

dnnl::memory::desc Desc(const View& v) {
  return dnnl::memory::desc(dnnl::memory::dims(v.dims.begin(), v.dims.end()),
                            dnnl::memory::data_type::f32,
                            dnnl::memory::dims(v.strides.begin(), v.strides.end()));
}

dnnl::memory::desc Any(const View& v) {
  return dnnl::memory::desc(dnnl::memory::dims(v.dims.begin(), v.dims.end()),
                            dnnl::memory::data_type::f32, dnnl::memory::format_tag::any);
}

const dnnl::engine& Engine() {
  static const dnnl::engine* const e = new dnnl::engine(dnnl::engine::kind::cpu, 0);
  return *e;
}

// The window of a oneDNN convolution: strides, dilations (0: none) and
// zero padding on each side.
struct Window {
  dnnl::memory::dims strides, dilates, lo, hi;
};

// Runs `prim` with `ins` reordered into the layouts its descriptor wants
// and its output reordered back into `out`'s.
void Execute(const dnnl::primitive& prim,
             const std::vector<std::tuple<int, const View*, dnnl::memory::desc>>& ins, int out_arg,
             const View& out, const dnnl::memory::desc& out_want) {
  const dnnl::engine& eng = Engine();
  dnnl::stream strm(eng);
  std::unordered_map<int, dnnl::memory> args;
  for (const auto& [arg, view, want] : ins) {
    dnnl::memory user(Desc(*view), eng, view->data);
    if (want == user.get_desc()) {
      args[arg] = user;
    } else {
      dnnl::memory m(want, eng);
      dnnl::reorder(user, m).execute(strm, user, m);
      args[arg] = m;
    }
  }
  dnnl::memory user_out(Desc(out), eng, out.data);
  dnnl::memory o = out_want == user_out.get_desc() ? user_out : dnnl::memory(out_want, eng);
  args[out_arg] = o;
  prim.execute(strm, args);
  if (o != user_out) dnnl::reorder(o, user_out).execute(strm, o, user_out);
  strm.wait();
}

// dst = conv(src [N, C, S...], wei [(G,) O, I, S...]).
void Forward(const View& src, const View& wei, const View& dst, const Window& w) {
  const dnnl::convolution_forward::desc desc(dnnl::prop_kind::forward_inference,
                                             dnnl::algorithm::convolution_direct, Any(src),
                                             Any(wei), Any(dst), w.strides, w.dilates, w.lo, w.hi);
  const dnnl::convolution_forward::primitive_desc pd(desc, Engine());
  Execute(dnnl::convolution_forward(pd),
          {{DNNL_ARG_SRC, &src, pd.src_desc()}, {DNNL_ARG_WEIGHTS, &wei, pd.weights_desc()}},
          DNNL_ARG_DST, dst, pd.dst_desc());
}

// diff_wei of dst = conv(src, wei), given diff_dst: what a convolution
// whose window is the size of its input computes (a weight gradient).
void BackwardWeights(const View& src, const View& diff_dst, const View& diff_wei, const Window& w) {
  const dnnl::convolution_forward::desc fwd(
      dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct, Any(src),
      Any(diff_wei), Any(diff_dst), w.strides, w.dilates, w.lo, w.hi);
  const dnnl::convolution_forward::primitive_desc fwd_pd(fwd, Engine());
  const dnnl::convolution_backward_weights::desc desc(dnnl::algorithm::convolution_direct, Any(src),
                                                      Any(diff_wei), Any(diff_dst), w.strides,
                                                      w.dilates, w.lo, w.hi);
  const dnnl::convolution_backward_weights::primitive_desc pd(desc, Engine(), fwd_pd);
  Execute(dnnl::convolution_backward_weights(pd),
          {{DNNL_ARG_SRC, &src, pd.src_desc()}, {DNNL_ARG_DIFF_DST, &diff_dst, pd.diff_dst_desc()}},
          DNNL_ARG_DIFF_WEIGHTS, diff_wei, pd.diff_weights_desc());
}

// A convolution whose window outweighs its output, with no input dilation
// or feature groups, is the weight gradient of another (JAX's transpose of
// its rhs): lhs's batch and feature swap roles, rhs is that one's output
// gradient, strides and rhs dilations swap. oneDNN's weight-gradient kernel
// runs it far faster than a forward convolution with a huge window.
bool AsWeightGradient(const View& lhs, const View& rhs, const View& out,
                      const v1::ConvolutionAttrs& a) {
  const int s = a.input_spatial_dimensions_size();
  int64_t window = 1, outputs = 1;
  for (int i = 0; i < s; ++i) {
    window *= rhs.dims[2 + i];
    outputs *= out.dims[2 + i];
    if (a.lhs_dilation(i) != 1 || a.padding_low(i) < 0) return false;
  }
  if (a.feature_group_count() != 1 || window <= outputs) return false;
  // The forward convolution: src = lhs as [C, N, S], diff_dst = rhs as
  // [I, O, W], weights = out as [O, B, K] (grouped by batch groups).
  auto swap01 = [](View v) {
    std::swap(v.dims[0], v.dims[1]);
    std::swap(v.strides[0], v.strides[1]);
    return v;
  };
  const View src = swap01(lhs), diff_dst = swap01(rhs);
  const View diff_wei = Grouped(swap01(out), a.batch_group_count());
  Window w;
  for (int i = 0; i < s; ++i) {
    w.strides.push_back(a.rhs_dilation(i));
    w.dilates.push_back(a.window_strides(i) - 1);
    w.lo.push_back(a.padding_low(i));
    // The padding past the last window that oneDNN's shape check expects.
    const int64_t hi = (diff_dst.dims[2 + i] - 1) * a.rhs_dilation(i) +
                       DilatedExtent(out.dims[2 + i], a.window_strides(i)) - src.dims[2 + i] -
                       a.padding_low(i);
    if (hi < 0) return false;
    w.hi.push_back(hi);
  }
  BackwardWeights(src, diff_dst, diff_wei, w);
  return true;
}

void ConvolutionF32(const v1::TensorType& lt, const void* lhs, const v1::TensorType& rt,
                    const void* rhs, const v1::ConvolutionAttrs& a, const v1::TensorType& ot,
                    void* out) {
  omp_set_num_threads(KernelThreads());
  const ConvolutionSpecs ord = ConvolutionSpecsOf(a);
  const int s = a.input_spatial_dimensions_size();
  View src = ViewOf(lt, lhs, ord.lhs);
  const View wei = ViewOf(rt, rhs, ord.rhs);
  const View dst = ViewOf(ot, out, ord.out);
  if (AsWeightGradient(src, wei, dst, a)) return;
  // Input dilation and negative padding become a padded copy (oneDNN has
  // neither).
  Window w;
  bool materialize = false;
  for (int i = 0; i < s; ++i) {
    w.strides.push_back(a.window_strides(i));
    w.dilates.push_back(a.rhs_dilation(i) - 1);
    w.lo.push_back(a.padding_low(i));
    w.hi.push_back(a.padding_high(i));
    materialize |= a.lhs_dilation(i) > 1 || w.lo[i] < 0 || w.hi[i] < 0;
  }
  std::vector<float> padded;
  if (materialize) {
    v1::TensorType in = lt, to = lt;
    v1::PadAttrs pad;
    for (int d = 0; d < lt.dims_size(); ++d) {
      pad.add_low(0);
      pad.add_high(0);
      pad.add_interior(0);
    }
    for (int i = 0; i < s; ++i) {
      const int64_t d = a.input_spatial_dimensions(i);
      pad.set_low(d, w.lo[i]);
      pad.set_high(d, w.hi[i]);
      pad.set_interior(d, a.lhs_dilation(i) - 1);
      to.set_dims(d, DilatedExtent(lt.dims(d), a.lhs_dilation(i)) + w.lo[i] + w.hi[i]);
      w.lo[i] = w.hi[i] = 0;
    }
    padded.resize(NumElementsUnchecked(to));
    const float zero = 0;
    Pad(in, lhs, &zero, pad, to, padded.data());
    src = ViewOf(to, padded.data(), ord.lhs);
  }
  // Batch groups: lhs's batch block g with rhs's output-feature block g
  // gives the output's feature block g.
  const int64_t bg = a.batch_group_count();
  for (int64_t g = 0; g < bg; ++g) {
    Forward(Block(src, 0, g, bg), Grouped(Block(wei, 0, g, bg), a.feature_group_count()),
            Block(dst, 1, g, bg), w);
  }
}

}  // namespace

void ConvolutionDirect(const v1::TensorType& lt, const void* lhs, const v1::TensorType& rt,
                       const void* rhs, const v1::ConvolutionAttrs& attrs, const v1::TensorType& ot,
                       void* out) {
  const v1::ConvolutionAttrs a = ConvolutionWithDefaults(attrs);
  TESSEL_DISPATCH(lt.dtype(), D, Direct<D>(lt, lhs, rt, rhs, a, ot, out));
}

void Convolution(const v1::TensorType& lt, const void* lhs, const v1::TensorType& rt,
                 const void* rhs, const v1::ConvolutionAttrs& attrs, const v1::TensorType& ot,
                 void* out) {
  const v1::ConvolutionAttrs a = ConvolutionWithDefaults(attrs);
  const int s = a.input_spatial_dimensions_size();
  if (NumElementsUnchecked(ot) == 0) return;
  const bool empty_window = NumElementsUnchecked(lt) == 0 || NumElementsUnchecked(rt) == 0;
  if (lt.dtype() == v1::F32 && s >= 1 && s <= 3 && !empty_window) {
    // oneDNN reports a failure (a configuration it refuses, memory it
    // cannot get for a reorder) by throwing; the direct loop, which writes
    // every output element, answers instead.
    try {
      ConvolutionF32(lt, lhs, rt, rhs, a, ot, out);
      return;
    } catch (const dnnl::error&) {
    }
  }
  TESSEL_DISPATCH(lt.dtype(), D, Direct<D>(lt, lhs, rt, rhs, a, ot, out));
}

}  // namespace tessel::cpu
