#include "lockstep/train/upcycling.h"

#include "lockstep/core/error.h"
#include "lockstep/tensor/param_table.h"
#include "lockstep/train/checkpoint.h"

namespace lockstep {

namespace {

// "<layer>moe.<rest>" -> ("<layer>", rest), <layer> a decoder layer's "layers.<l>." or an MTP depth's
// "mtp.layers.<k>."; ("", "") for any other name.
std::pair<std::string, std::string> moe_param(const std::string& name) {
  const size_t at = name.find(".moe.");
  const std::string layer = at == std::string::npos ? "" : name.substr(0, at + 1);
  for (const std::string head : {"layers.", "mtp.layers."})
    if (layer.rfind(head, 0) == 0 && layer.find('.', head.size()) == layer.size() - 1)
      return {layer, name.substr(at + 5)};
  return {"", ""};
}

}  // namespace

void upcycle(ParamStore& ps, const ModelConfig& m, const MoeConfig& moe,
             const std::function<std::vector<float>(const std::string& name, const Shape& shape)>& dense) {
  const int64_t C = m.hidden_size, F = m.ffn_hidden(), Fe = moe.ffn_hidden_size ? moe.ffn_hidden_size : F;
  const int64_t E = moe.num_experts, G = F / Fe, K = moe.router_topk;
  const bool swiglu = m.activation == "swiglu";
  const float scale = moe.router_pre_softmax ? static_cast<float>(static_cast<double>(E * G) / static_cast<double>(K))
                                             : static_cast<float>(G);
  const int64_t halves = swiglu ? 2 : 1;
  for (int i = 0; i < static_cast<int>(ps.specs().size()); ++i) {
    const ParamSpec& spec = ps.specs()[i];
    const auto [layer, rest] = moe_param(spec.name);
    std::vector<float> whole;
    if (layer.empty()) {
      whole = dense(spec.name, spec.global_shape);
    } else if (rest == "router.weight") {
      // The job's own draw, its first E / G rows each repeated G times (the router is never split).
      LOCKSTEP_CHECK(spec.shape == spec.global_shape, "upcycling: the router is split");
      const float* drawn = ps.value(i);
      whole.resize(static_cast<size_t>(E * C));
      for (int64_t e = 0; e < E; ++e) std::copy_n(drawn + (e / G) * C, C, whole.data() + e * C);
    } else {
      const std::string mlp = layer + "mlp.";
      whole.resize(static_cast<size_t>(spec.global_shape.numel()));
      if (rest == "experts.fc.weight" || rest == "experts.fc.bias") {
        // (E, halves x Fe[, C]): expert e's half h is rows [h F + g Fe, h F + (g+1) Fe) of the dense fc.
        const bool w = rest == "experts.fc.weight";
        const int64_t width = w ? C : 1;
        const std::vector<float> fc =
            dense(mlp + (w ? "fc.weight" : "fc.bias"), w ? Shape{halves * F, C} : Shape{halves * F});
        for (int64_t e = 0; e < E; ++e)
          for (int64_t h = 0; h < halves; ++h)
            std::copy_n(fc.data() + (h * F + (e % G) * Fe) * width, Fe * width,
                        whole.data() + ((e * halves + h) * Fe) * width);
      } else if (rest == "experts.proj.weight") {
        // (E, C, Fe): columns [g Fe, (g+1) Fe) of the dense (C, F) proj, times the output scale.
        const std::vector<float> proj = dense(mlp + "proj.weight", Shape{C, F});
        for (int64_t e = 0; e < E; ++e)
          for (int64_t c = 0; c < C; ++c)
            for (int64_t j = 0; j < Fe; ++j)
              whole[static_cast<size_t>((e * C + c) * Fe + j)] =
                  proj[static_cast<size_t>(c * F + (e % G) * Fe + j)] * scale;
      } else if (rest == "experts.proj.bias") {
        // Added by every chosen expert with weights that sum to one: the dense bias as it is.
        const std::vector<float> bias = dense(mlp + "proj.bias", Shape{C});
        for (int64_t e = 0; e < E; ++e) std::copy(bias.begin(), bias.end(), whole.begin() + e * C);
      } else {
        user_error("moe.use_upcycling: the dense checkpoint has no counterpart of '", spec.name, "'");
      }
    }
    set_param_from_whole(ps, i, whole.data());
  }
}

}  // namespace lockstep
