// lockstep ckpt inspect DIR | verify DIR | export DIR OUT.safetensors
//              | export DIR OUT --format hf [--tokenizer TOKENIZER_JSON_OR_DIR]
//
// DIR is a checkpoint (RUN/checkpoints/step-NNNNNNNN), a directory of them or a run directory (its newest
// one). verify exits 1 on a bad checkpoint, with one line saying what and where.
#include <cstdio>
#include <filesystem>
#include <map>

#include "lockstep/cli/commands.h"
#include "lockstep/config/hf_config.h"
#include "lockstep/core/error.h"
#include "lockstep/train/checkpoint.h"
#include "lockstep/train/hf_checkpoint.h"
#include "lockstep/train/safetensors.h"

namespace lockstep::cli {

namespace {

std::string megabytes(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f MB", static_cast<double>(bytes) / 1e6);
  return buf;
}

void inspect(const std::string& dir) {
  const CheckpointMetadata meta = read_checkpoint_metadata(dir);
  const CheckpointInfo& info = meta.info;
  const CheckpointLayout& l = info.layout;
  int64_t total = 0;
  for (const CheckpointFile& f : meta.files) total += f.bytes;
  std::printf("checkpoint %s\n", dir.c_str());
  std::printf("  format version %d, step %lld, %lld samples (%lld tokens) consumed, seed %llu, lr %.6g (%s)\n",
              meta.format_version, (long long)info.step, (long long)info.samples_consumed,
              (long long)info.tokens_consumed, (unsigned long long)info.seed, info.lr, info.lr_schedule.c_str());
  std::printf("  layout: %d ranks: tp %d x cp %d x dp %d x pp %d; experts: etp %d x ep %d; distributed optimizer %s\n",
              l.world, l.tp, l.cp, l.dp, l.pp, l.etp, l.ep, l.distributed_optimizer ? "on" : "off");
  std::printf("  %zu files, %s:", meta.files.size(), megabytes(total).c_str());
  for (const CheckpointFile& f : meta.files) std::printf(" %s (%s)", f.name.c_str(), megabytes(f.bytes).c_str());
  std::printf("\n  %zu tensors:\n", meta.tensors.size());
  for (const CheckpointTensor& t : meta.tensors) {
    int64_t bytes = 0;
    for (const CheckpointPiece& p : t.pieces) bytes += p.bytes;
    std::printf("    %-48s %-5s %-16s %s, %zu shard%s\n", t.name.c_str(), std::string(dtype_name(t.dtype)).c_str(),
                t.global_shape.to_string().c_str(), megabytes(bytes).c_str(), t.pieces.size(),
                t.pieces.size() == 1 ? "" : "s");
  }
}

void export_weights(const std::string& dir, const std::string& out) {
  const CheckpointMetadata meta = read_checkpoint_metadata(dir);
  constexpr std::string_view prefix = "param/";
  std::vector<std::vector<char>> data;
  std::vector<SafetensorsTensor> tensors;
  for (const CheckpointTensor& t : meta.tensors) {
    if (t.name.compare(0, prefix.size(), prefix) != 0) continue;
    data.push_back(read_checkpoint_tensor(meta, t));
    tensors.push_back({t.name.substr(prefix.size()), t.dtype, t.global_shape, data.back().data()});
  }
  if (tensors.empty()) user_error("checkpoint '", dir, "' holds no parameters");
  write_safetensors(out, tensors, {{"format", "pt"}, {"lockstep_step", std::to_string(meta.info.step)}});
  std::printf("wrote %s: %zu tensors from %s (step %lld)\n", out.c_str(), tensors.size(), dir.c_str(),
              (long long)meta.info.step);
}

// A Hugging Face model directory (train/hf_checkpoint.h) from the checkpoint's parameters and the
// model keys of the config it was written with, and the tokenizer files: `tokenizer`'s, or, with
// none given, those of the Hugging Face directory the run was initialised from (train.init_from =
// "hf:DIR"), when it has them.
void export_hf(const std::string& dir, const std::string& out, const std::string& tokenizer) {
  const CheckpointMetadata meta = read_checkpoint_metadata(dir);
  const Config config = load_config_text(meta.info.config_toml, "checkpoint '" + dir + "' config");
  const std::string& init = config.train.init_from;
  const std::vector<std::string> tokenizer_files =
      !tokenizer.empty()          ? hf_tokenizer_files(tokenizer, config.model.vocab_size, true)
      : init.rfind("hf:", 0) == 0 ? hf_tokenizer_files(init.substr(3), config.model.vocab_size, false)
                                  : std::vector<std::string>{};
  std::map<std::string, std::vector<char>> params;
  for (const CheckpointTensor& t : meta.tensors)
    if (t.name.rfind("param/", 0) == 0)
      params[t.name.substr(6)] = read_checkpoint_tensor(meta, t);
    else if (t.name.ends_with(".moe.router.expert_bias"))  // "buffer/...": deepseek_v3's e_score_correction_bias
      params[t.name] = read_checkpoint_tensor(meta, t);
  const int64_t n = write_hf_checkpoint(
      out, config.model, config.moe,
      [&](const std::string& name) {
        const auto it = params.find(name);
        if (it == params.end()) user_error("checkpoint '", dir, "' has no parameter '", name, "'");
        return reinterpret_cast<const float*>(it->second.data());
      },
      tokenizer_files);
  std::string extra;
  for (const std::string& f : tokenizer_files) extra += ", " + std::filesystem::path(f).filename().string();
  std::printf("wrote %s: config.json (%s), model.safetensors%s; %lld tensors from %s (step %lld)\n", out.c_str(),
              hf_family(config.model, config.moe).c_str(), extra.c_str(), (long long)n, dir.c_str(),
              (long long)meta.info.step);
}

}  // namespace

int ckpt_command(const std::vector<std::string>& args) {
  const std::string sub = args.empty() ? "" : args[0];
  if (sub == "inspect" && args.size() == 2) {
    inspect(find_checkpoint(args[1]));
    return 0;
  }
  if (sub == "verify" && args.size() == 2) {
    std::string dir = args[1];
    try {
      dir = find_checkpoint(args[1]);
      verify_checkpoint(dir);
    } catch (const UserError& e) {
      std::fprintf(stderr, "lockstep: ckpt verify: %s\n", e.what());
      return 1;
    }
    std::printf("%s: ok\n", dir.c_str());
    return 0;
  }
  if (sub == "export" && args.size() == 3) {
    export_weights(find_checkpoint(args[1]), args[2]);
    return 0;
  }
  const bool tokenizer = args.size() == 7 && args[5] == "--tokenizer";
  if (sub == "export" && (args.size() == 5 || tokenizer) && args[3] == "--format") {
    if (args[4] == "hf")
      export_hf(find_checkpoint(args[1]), args[2], tokenizer ? args[6] : "");
    else if (args[4] == "safetensors" && !tokenizer)
      export_weights(find_checkpoint(args[1]), args[2]);
    else
      user_error("ckpt export --format ", args[4], tokenizer ? " --tokenizer" : "", ": expected safetensors or hf",
                 tokenizer ? " (a tokenizer goes with --format hf)" : "");
    return 0;
  }
  user_error(
      "usage: lockstep ckpt inspect DIR | verify DIR | export DIR OUT.safetensors | export DIR OUT --format hf "
      "[--tokenizer TOKENIZER_JSON_OR_DIR]");
}

}  // namespace lockstep::cli
