#include "verify/cli/cli.h"

#include <CLI/CLI.hpp>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <iostream>
#include <limits>

#include "io/atomic_file.h"
#include "io/hf_checkpoint.h"
#include "io/untrusted_text.h"
#include "verify/commands/check_run.h"
#include "verify/report/html_report.h"
#include "verify/commands/profile_run.h"
#include "verify/report/report.h"
#include "verify/commands/sweep.h"
#include "verify/commands/train_run.h"
#include "verify/setup/validate.h"
#include "verify/commands/verify_run.h"
#include "verify/setup/model_description.h"

namespace tpsim {

namespace {

// Flags as the user typed them, before they become RunOptions.
struct RawFlags {
  std::string model = "mlp";
  std::string tp;  // empty: train 1; verify 1,2,4,8 for the mlp, 1,2 for the gpt
  std::string dtype;
  std::string steps;       // empty: the model's default
  std::string batch_size;  // empty: the model's default
  std::string seed = "1234";
  std::string fault = "none";
  std::string backend = "cpu";
  std::string comm = "auto";
  std::string launch = "auto";
  std::string batch;   // empty: verify boundary, train and profile random
  std::string preset;  // gpt: seed (the defaults) or small (the sweep's)
  bool free_running = false;  // verify: f32 and bf16 steps not restarted from the reference
  // The architecture, over the --model family's choices: empty or 0 where not given.
  std::string norm, mlp, positions, rope_style;
  std::string recompute;  // empty: none
  std::string moe_score;  // empty: the family's
  std::string moe_aux_scope = "aux_loss";
  int moe_renorm = 0, no_moe_renorm = 0, moe_bias = 0, no_moe_bias = 0;
  int norm_bias = 0, no_norm_bias = 0, linear_bias = 0, no_linear_bias = 0;
  int tied = 0, untied = 0;
  std::string optimizer = "adam", lr_decay_style = "constant", decay_params = "all";
};

// Flags that describe one configuration. Without --model, verify runs the default sweep,
// which picks its own configurations, so these need --model.
const char* kSingleRunFlags[] = {"--tp", "--vocab-size", "--block-size", "--hidden", "--heads",
                                 "--layers", "--batch-size", "--seq-len", "--load", "--data",
                                 "--loss-parallel", "--sequence-parallel",
                                 "--make-vocab-divisible-by", "--resync", "--batch", "--preset",
                                 "--lr", "--weight-decay", "--optimizer", "--adam-beta1",
                                 "--adam-beta2", "--adam-eps", "--sgd-momentum",
                                 "--weight-decay-params",
                                 "--lr-warmup-iters", "--lr-warmup-init", "--lr-decay-style",
                                 "--lr-decay-iters", "--min-lr", "--html", "--norm", "--norm-bias",
                                 "--no-norm-bias", "--linear-bias", "--no-linear-bias", "--mlp",
                                 "--ffn-hidden", "--positions", "--rope-theta", "--rope-style",
                                 "--kv-heads", "--tied-embeddings", "--untied-embeddings",
                                 "--dropout", "--recompute", "--recompute-layers", "--dp",
                                 "--clip-grad", "--num-experts", "--moe-router-topk",
                                 "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size",
                                 "--moe-router-score-function", "--moe-router-topk-renorm",
                                 "--no-moe-router-topk-renorm", "--moe-aux-loss-coeff",
                                 "--moe-router-load-balancing-type",
                                 "--moe-z-loss-coeff", "--moe-router-enable-expert-bias",
                                 "--no-moe-router-enable-expert-bias",
                                 "--moe-router-bias-update-rate", "--moe-expert-capacity-factor",
                                 "--moe-global-capacity", "--moe-layer-freq", "--ep", "--etp"};

// --preset small: the sweep's small GPT, for the fields the user did not set.
void apply_preset(const CLI::App& cmd, RunOptions& o, const RawFlags& raw) {
  if (raw.preset.empty() || raw.preset == "seed") return;
  const GptConfig small = small_gpt_config();
  auto unset = [&](const char* flag) { return cmd.count(flag) == 0; };
  if (unset("--vocab-size")) o.gpt.vocab_size = small.vocab_size;
  if (unset("--block-size")) o.gpt.block_size = small.block_size;
  if (unset("--hidden")) o.gpt.hidden = small.hidden;
  if (unset("--heads")) o.gpt.heads = small.heads;
  if (unset("--layers")) o.gpt.layers = small.layers;
  if (unset("--seq-len")) o.seq_len = kSmallGptSeqLen;
  if (unset("--batch-size")) o.batch_size = kSmallGptBatch;
}

// --model's choices: the MLP, then apply_gpt_family's (model/config.h, the one table).
std::vector<std::string> model_names() {
  std::vector<std::string> names{"mlp"};
  names.insert(names.end(), std::begin(kGptFamilies), std::end(kGptFamilies));
  return names;
}

// The GPT's optimizer and learning-rate schedule (config.h), with Megatron's spellings.
void add_optimizer_flags(CLI::App& cmd, RunOptions& o, RawFlags& raw) {
  cmd.add_option("--optimizer", raw.optimizer,
                 "gpt: adam (torch.optim.Adam, weight decay as L2 in the gradient), adamw (torch.optim.AdamW, decoupled decay: Megatron-core's adam) "
                 "or sgd (torch.optim.SGD with --sgd-momentum, L2 decay)")
      ->check(CLI::IsMember({"adam", "adamw", "sgd"}));
  cmd.add_option("--weight-decay", o.adam.weight_decay,
                 "gpt: weight decay, L2 for --optimizer adam and sgd, decoupled for adamw");
  cmd.add_option("--weight-decay-params", raw.decay_params,
                 "gpt: all (every parameter decays: torchtitan's) or 2d (biases "
                 "and norm weights, the parameters of one dimension, do not: Megatron-core's "
                 "and Hugging Face Trainer's default)")
      ->check(CLI::IsMember({"all", "2d"}));
  cmd.add_option("--adam-beta1", o.adam.beta1, "gpt: Adam's beta1");
  cmd.add_option("--adam-beta2", o.adam.beta2, "gpt: Adam's beta2 (Megatron's default: 0.999)");
  cmd.add_option("--adam-eps", o.adam.eps, "gpt: Adam's eps");
  cmd.add_option("--sgd-momentum", o.adam.momentum,
                 "gpt with --optimizer sgd: momentum (0: none)");
  cmd.add_option("--lr-warmup-iters", o.adam.schedule.warmup_iters,
                 "gpt: steps of linear warm-up from --lr-warmup-init to --lr, as Megatron's "
                 "(step 1 runs at --lr-warmup-init; 0: none)");
  cmd.add_option("--lr-warmup-init", o.adam.schedule.warmup_init,
                 "gpt: the learning rate warm-up starts from");
  cmd.add_option("--lr-decay-style", raw.lr_decay_style,
                 "gpt: constant, linear or cosine decay from --lr to --min-lr "
                 "after the warm-up, as Megatron's (whose default is linear)")
      ->check(CLI::IsMember({"constant", "linear", "cosine"}));
  cmd.add_option("--lr-decay-iters", o.adam.schedule.decay_iters,
                 "gpt: the step count the decay ends at, warm-up included (0: --steps)");
  cmd.add_option("--min-lr", o.adam.schedule.min_lr,
                 "gpt: the learning rate after the decay");
}

void add_model_flags(CLI::App& cmd, RunOptions& o, RawFlags& raw, bool tp_list) {
  cmd.add_option("-m,--model", raw.model,
                 "mlp (the seed's naive TP MLP); gpt (the seed's transformer), gpt2 (LayerNorm "
                 "and Linear biases, tanh GELU), llama (RMSNorm, SwiGLU, RoPE, untied head), "
                 "mixtral (llama with 8 experts, top 2, softmax) or deepseek-moe (16 experts of "
                 "F/4, top 4, a shared expert of F/2, sigmoid scores, expert bias), each a set "
                 "of the architecture flags below; verify without --model runs the default sweep")
      ->check(CLI::IsMember(model_names()));
  cmd.add_option("-t,--tp", raw.tp,
                 tp_list ? "TP degrees to verify, comma-separated (default: mlp 1,2,4,8, gpt 1,2)"
                         : "TP degree (number of ranks)")
      ->check([](const std::string& s) { return s.empty() ? "'': empty list" : ""; });
  cmd.add_option("-d,--dtype", raw.dtype, "f32, f64 or bf16 (mixed precision: bf16 weights and activations, f32 "
                 "statistics, main gradients, master weights and Adam state): the sharded "
                 "model's precision");
  cmd.add_option("-s,--steps", raw.steps, "training steps (default: mlp 2, gpt 5)");
  cmd.add_option("--lr", o.lr, "learning rate (mlp: SGD; gpt: --optimizer's, the peak of the "
                               "--lr-* schedule)");
  add_optimizer_flags(cmd, o, raw);
  cmd.add_option("--seed", raw.seed, "seed of weights and data (0 or more)");
  cmd.add_option("--vocab-size", o.gpt.vocab_size, "gpt vocabulary size");
  cmd.add_option("--block-size,--max-position-embeddings", o.gpt.block_size, "gpt context length (wpe rows)");
  cmd.add_option("--hidden,--hidden-size", o.gpt.hidden, "gpt hidden size H");
  cmd.add_option("--heads,--num-attention-heads", o.gpt.heads, "gpt attention heads");
  cmd.add_option("--layers,--num-layers", o.gpt.layers, "gpt transformer blocks");
  cmd.add_option("--norm", raw.norm, "architecture: layernorm or rmsnorm")
      ->check(CLI::IsMember({"layernorm", "rmsnorm"}));
  cmd.add_flag("--norm-bias", raw.norm_bias, "architecture: LayerNorm with a bias");
  cmd.add_flag("--no-norm-bias", raw.no_norm_bias, "architecture: LayerNorm without a bias");
  cmd.add_flag("--linear-bias", raw.linear_bias, "architecture: a bias on every Linear of the blocks");
  cmd.add_flag("--no-linear-bias", raw.no_linear_bias, "architecture: Linears without biases");
  cmd.add_option("--mlp", raw.mlp, "architecture: gelu (exact), gelu-tanh or swiglu")
      ->check(CLI::IsMember({"gelu", "gelu-tanh", "swiglu"}));
  cmd.add_option("--ffn-hidden,--ffn-hidden-size", o.gpt.ffn_hidden,
                 "architecture: the MLP's hidden size F (0: 4H, or 8H/3 up to a multiple of 64 "
                 "for swiglu)");
  cmd.add_option("--positions", raw.positions, "architecture: learned (wpe) or rope")
      ->check(CLI::IsMember({"learned", "rope"}));
  cmd.add_option("--rope-theta,--rotary-base", o.gpt.rope_theta, "architecture: RoPE's base");
  cmd.add_option("--rope-style", raw.rope_style,
                 "architecture: half (pairs i, i+d/2: Hugging Face, Megatron) or interleaved "
                 "(pairs 2i, 2i+1: Meta, torchtitan)")
      ->check(CLI::IsMember({"half", "interleaved"}));
  cmd.add_option("--kv-heads,--num-query-groups", o.gpt.kv_heads,
                 "architecture: key/value heads (0: --heads; fewer: grouped-query; 1: multi-query)");
  cmd.add_flag("--tied-embeddings", raw.tied, "architecture: the LM head is wte");
  cmd.add_flag("--untied-embeddings", raw.untied, "architecture: the LM head is its own lm_head.weight");
  cmd.add_option("--dropout", o.gpt.dropout,
                 "architecture: dropout probability on the embeddings, attention probabilities "
                 "and residual branches (0: none, the default); masks are drawn by global index, "
                 "so every TP layout draws the same");
  cmd.add_option("--num-experts", o.gpt.num_experts,
                 "MoE (docs/moe.md): routed experts E per MoE layer (0: dense)");
  cmd.add_option("--moe-router-topk", o.gpt.moe_topk, "MoE: experts per token K");
  cmd.add_option("--moe-ffn-hidden-size", o.gpt.moe_ffn_hidden,
                 "MoE: an expert's SwiGLU width (0: --ffn-hidden's)");
  cmd.add_option("--moe-shared-expert-intermediate-size", o.gpt.moe_shared_ffn,
                 "MoE: the shared expert's width, a dense TP MLP every token sees (0: none)");
  cmd.add_option("--moe-router-score-function", raw.moe_score, "MoE: softmax or sigmoid")
      ->check(CLI::IsMember({"softmax", "sigmoid"}));
  cmd.add_flag("--moe-router-topk-renorm", raw.moe_renorm,
               "MoE: divide the k gates by their sum");
  cmd.add_flag("--no-moe-router-topk-renorm", raw.no_moe_renorm, "MoE: the k scores as gates");
  cmd.add_option("--moe-aux-loss-coeff", o.gpt.moe_aux_coeff,
                 "MoE: Switch load-balancing loss (0: none)");
  cmd.add_option("--moe-router-load-balancing-type", raw.moe_aux_scope,
                 "MoE: aux_loss (the default: each micro-batch's, a --dp replica's batch, the "
                 "loss their mean) or global_aux_loss (the global batch's)")
      ->check(CLI::IsMember({"aux_loss", "global_aux_loss"}));
  cmd.add_option("--moe-z-loss-coeff", o.gpt.moe_z_coeff, "MoE: router z-loss (0: none)");
  cmd.add_flag("--moe-router-enable-expert-bias", raw.moe_bias,
               "MoE: DeepSeek-V3's expert bias, added to the scores to choose the experts and "
               "moved after each step towards the mean load of the global batch, counted after "
               "capacity dropping (Megatron-core's); train --save-final writes it, --load reads it");
  cmd.add_flag("--no-moe-router-enable-expert-bias", raw.no_moe_bias, "MoE: no expert bias");
  cmd.add_option("--moe-router-bias-update-rate", o.gpt.moe_bias_rate,
                 "MoE: the expert bias's step (default 1e-3)");
  cmd.add_option("--moe-expert-capacity-factor", o.gpt.moe_capacity_factor,
                 "MoE: each expert keeps ceil((tokens x K / E) x factor) (Megatron-core's "
                 "get_capacity, in floating point) of the tokens each rank routes, the highest "
                 "gates first, then the lowest token index (0: no dropping)");
  cmd.add_flag("--moe-global-capacity", o.gpt.moe_global_capacity,
               "MoE: tpsim's own capacity, over the global batch's tokens instead of each "
               "rank's, so that every folding drops the same tokens (Megatron-core: per rank)");
  cmd.add_option("--moe-layer-freq", o.gpt.moe_layer_freq,
                 "MoE: layer l is an MoE layer when l % freq == 0 (default 1: every layer)");
  cmd.add_option("--ep,--expert-model-parallel-size", o.ep,
                 "MoE: expert parallel, the experts split over ep ranks (ranks ordered ETP "
                 "fastest, then EP, then expert-DP over the same world; default 1)");
  cmd.add_option("--etp,--expert-tensor-parallel-size", o.etp, "MoE: each expert's Linears split over etp ranks (default 1)");
  cmd.add_option("-b,--batch-size", raw.batch_size, "batch rows (default: mlp 32, gpt 2)");
  cmd.add_option("--seq-len", o.seq_len, "gpt sequence length T");
  cmd.add_option("--load", o.load_path,
                 "start from weights in a safetensors file, or a Hugging Face Llama or GPT-2 "
                 "checkpoint directory (config.json, model.safetensors or its shards; with "
                 "--model llama or gpt2, its config is the model)");
  cmd.add_option("--data", o.data_path, "gpt batch (input_ids, labels) from a safetensors file");
  cmd.add_option("--batch", raw.batch,
                 "gpt batch without --data: random (the seed's uniform ids) or boundary (the "
                 "same, with every vocabulary shard's first and last id as labels and ignored "
                 "labels mid-row); default: verify boundary, train and profile random")
      ->check(CLI::IsMember({"random", "boundary"}));
  cmd.add_option("--preset", raw.preset,
                 "gpt sizes: seed (V 50257, H 256, A 8, L 2, batch 2x64; the default) or small "
                 "(the default sweep's V 101, H 72, A 12, L 2, batch 2x24)")
      ->check(CLI::IsMember({"seed", "small"}));
  cmd.add_flag("--loss-parallel", o.loss_parallel,
               "gpt: split wte/lm_head by vocabulary; cross-entropy on sharded logits");
  cmd.add_option("--recompute", raw.recompute,
                 "gpt: activation recomputation, as Megatron's: none (the default), selective "
                 "(the core attention again in backward from the kept q, k, v) or full (each "
                 "chunk of blocks keeps only its input and runs again in backward)")
      ->check(CLI::IsMember({"none", "selective", "full"}));
  cmd.add_option("--recompute-layers", o.recompute_layers,
                 "gpt with --recompute full: blocks per recompute chunk (default 1)");
  cmd.add_option("--dp", o.dp,
                 "gpt: data-parallel replicas around each TP group (dp x tp ranks, TP fastest); "
                 "each takes its rows of the batch, the loss is token-weighted over the global "
                 "batch, gradients are summed over the DP group (default 1)");
  cmd.add_option("--clip-grad", o.clip_grad,
                 "gpt: clip the gradients to this global L2 norm (every parameter counted "
                 "once), as torch.nn.utils.clip_grad_norm_; 0, the default: no clipping");
  cmd.add_flag("--sequence-parallel", o.sequence_parallel,
               "gpt: split LayerNorm/residual regions by tokens (all-gather / reduce-scatter)");
  cmd.add_option("--make-vocab-divisible-by", o.make_vocab_divisible_by,
                 "gpt with --loss-parallel: pad the vocabulary to a multiple of this times tp");
  cmd.add_option("--backend", raw.backend, "cpu, or cuda (a GPU per rank, or ranks sharing one)");
  cmd.add_option("--comm", raw.comm, "auto, threads (cpu), nccl (one GPU per rank) or sim "
                                     "(ranks sharing a GPU)");
  cmd.add_option("--launch", raw.launch,
                 "auto (mpi when mpirun started this process, else threads), threads (every "
                 "rank a thread of this process) or mpi (the ranks spread over the processes "
                 "of `mpirun -np P`, in blocks of ceil(world/P) threads; train and verify, docs/mpi.md)")
      ->check(CLI::IsMember({"auto", "threads", "mpi"}));
  cmd.add_option("--timeout", o.timeout_s, "seconds a collective may wait for a rank");
  cmd.add_option("--json", o.json_path, "write a machine-readable report here");
  cmd.add_flag("--force", o.force, "run even when the memory model predicts more than the "
                                   "memory available");
}

// --tp-invariant, the same mode on every subcommand; `what_else` says what this one adds.
void add_tp_invariant_flag(CLI::App& cmd, RunOptions& o, const std::string& what_else) {
  cmd.add_flag("--tp-invariant", o.tp_invariant,
               "gpt (cpu and cuda): split reductions in 8 canonical chunks summed in one order and "
               "GEMMs in canonical tiles, so that tp 1, 2, 4 and 8 compute the same bits" +
                   what_else);
}

// The --model family's architecture, then each architecture flag given over it.
void apply_architecture(const CLI::App& cmd, RunOptions& o, const RawFlags& raw) {
  GptConfig& c = o.gpt;
  const GptConfig given = c;  // the numbers the flags parsed into, which the family sets
  apply_gpt_family(c, raw.model == "mlp" ? "gpt" : raw.model);
  auto keep = [&](const char* flag, auto field) {
    if (cmd.count(flag) > 0) c.*field = given.*field;
  };
  keep("--num-experts", &GptConfig::num_experts);
  keep("--moe-router-topk", &GptConfig::moe_topk);
  keep("--moe-ffn-hidden-size", &GptConfig::moe_ffn_hidden);
  keep("--moe-shared-expert-intermediate-size", &GptConfig::moe_shared_ffn);
  auto pair = [](int on, int off, const char* a, const char* b, bool& field) {
    if (on && off) throw UsageError(std::string(a) + " and " + b + " exclude each other");
    if (on) field = true;
    if (off) field = false;
  };
  pair(raw.norm_bias, raw.no_norm_bias, "--norm-bias", "--no-norm-bias", c.norm_bias);
  pair(raw.linear_bias, raw.no_linear_bias, "--linear-bias", "--no-linear-bias", c.linear_bias);
  pair(raw.tied, raw.untied, "--tied-embeddings", "--untied-embeddings", c.tied_embeddings);
  if (!raw.norm.empty()) {
    c.norm = raw.norm == "rmsnorm" ? NormKind::RMSNorm : NormKind::LayerNorm;
    if (c.norm == NormKind::RMSNorm && !raw.norm_bias) c.norm_bias = false;
  }
  if (!raw.mlp.empty())
    c.mlp = raw.mlp == "swiglu"      ? MlpKind::SwiGLU
            : raw.mlp == "gelu-tanh" ? MlpKind::GeluTanh
                                     : MlpKind::Gelu;
  if (!raw.positions.empty())
    c.positions = raw.positions == "rope" ? PositionKind::Rope : PositionKind::Learned;
  if (!raw.rope_style.empty())
    c.rope_style = raw.rope_style == "interleaved" ? RopeStyle::Interleaved : RopeStyle::Half;
  pair(raw.moe_renorm, raw.no_moe_renorm, "--moe-router-topk-renorm",
       "--no-moe-router-topk-renorm", c.moe_topk_renorm);
  pair(raw.moe_bias, raw.no_moe_bias, "--moe-router-enable-expert-bias",
       "--no-moe-router-enable-expert-bias", c.moe_expert_bias);
  if (!raw.moe_score.empty())
    c.moe_score = raw.moe_score == "sigmoid" ? MoeScore::Sigmoid : MoeScore::Softmax;
  c.moe_aux_scope = raw.moe_aux_scope == "global_aux_loss" ? MoeAuxScope::Global : MoeAuxScope::MicroBatch;
}

// The family a Hugging Face config.json describes (io/hf_checkpoint.h reads these three).
std::string checkpoint_family(const GptConfig& c) {
  return c.moe() ? "mixtral" : c.swiglu() ? "llama" : "gpt2";
}

// --load DIR, a Hugging Face checkpoint: its config.json is the model, so no flag may say
// otherwise.
void apply_hf_checkpoint(const CLI::App& cmd, RunOptions& o, const RawFlags& raw) {
  if (o.load_path.empty() || !is_hf_model_dir(o.load_path)) return;
  const GptConfig c = read_hf_config(o.load_path);
  const std::string family = checkpoint_family(c);
  if (raw.model != family)
    throw UsageError("--load " + quote_text(o.load_path) + " is a Hugging Face " + family +
                     " checkpoint (config.json): add --model " + family);
  for (const char* flag : {"--preset", "--vocab-size", "--block-size", "--hidden", "--heads",
                           "--layers", "--norm", "--norm-bias", "--no-norm-bias", "--linear-bias",
                           "--no-linear-bias", "--mlp", "--ffn-hidden", "--positions",
                           "--rope-theta", "--rope-style", "--kv-heads", "--tied-embeddings",
                           "--untied-embeddings", "--num-experts", "--moe-router-topk",
                           "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size",
                           "--moe-router-score-function", "--moe-router-topk-renorm",
                           "--no-moe-router-topk-renorm", "--moe-layer-freq"})
    if (cmd.count(flag) > 0)
      throw UsageError(std::string(flag) + ": the model comes from " +
                       quote_text(o.load_path + "/config.json") + " (--load)");
  // The training settings stay the run's: dropout, and MoE's losses, capacity and bias.
  const GptConfig run = o.gpt;
  o.gpt = c;
  o.gpt.dropout = run.dropout;
  if (c.moe()) {
    o.gpt.moe_aux_coeff = run.moe_aux_coeff;
    o.gpt.moe_aux_scope = run.moe_aux_scope;
    o.gpt.moe_z_coeff = run.moe_z_coeff;
    o.gpt.moe_capacity_factor = run.moe_capacity_factor;
    o.gpt.moe_global_capacity = run.moe_global_capacity;
    o.gpt.moe_expert_bias = run.moe_expert_bias;
    o.gpt.moe_bias_rate = run.moe_bias_rate;
  }
}

// Under MPI, when one process of the job fails or dies, the launcher ends the others with
// SIGTERM. Each then says so in one line and exits 3 (a runtime failure), as the failing
// process does, unless it has printed its own line already. Signal state is per process by
// nature: these two are the program's, not the library's.
char g_terminated_line[256];
volatile std::sig_atomic_t g_reported = 0;

void on_launcher_sigterm(int) {
  if (!g_reported) {
    [[maybe_unused]] auto n = write(STDERR_FILENO, g_terminated_line, std::strlen(g_terminated_line));
  }
  _exit(kExitRuntime);
}

void say_so_when_the_launcher_ends_us(const DeviceOptions& dev) {
  if (process_count(dev) < 2) return;
  std::snprintf(g_terminated_line, sizeof g_terminated_line,
                "tpsim: runtime failure: process %d of %d: ended by the MPI launcher, because "
                "another process of the job failed or died first, or the job was interrupted\n",
                process_index(dev), process_count(dev));
  std::signal(SIGTERM, on_launcher_sigterm);
}

// A failed run's last act: its line is printed, so a SIGTERM need not print another, and
// under MPI the whole job ends (a peer may be stalled, or dead).
int failed_with(int code, const DeviceOptions& dev) {
  std::cout.flush();
  std::cerr.flush();
  g_reported = 1;
  end_processes_after_failure(dev, code);
  return code;
}

// What runs across MPI processes so far: train and verify. profile refuses in one line
// rather than run P copies of itself.
void refuse_across_processes(const RunOptions& o, const char* command) {
  if (process_count(o.device) > 1)
    throw UsageError(std::string(command) + " does not run across MPI processes yet (train "
                     "and verify do): run it in one process, without mpirun");
}

void finish_options(const CLI::App& cmd, RunOptions& o, const RawFlags& raw, DType default_dtype,
                    bool verify) {
  o.model = raw.model == "mlp" ? ModelKind::Mlp : ModelKind::Gpt;
  apply_architecture(cmd, o, raw);
  apply_hf_checkpoint(cmd, o, raw);
  o.recompute = raw.recompute == "selective" ? RecomputeKind::Selective
                : raw.recompute == "full"    ? RecomputeKind::Full
                                             : RecomputeKind::None;
  o.batch = raw.batch == "boundary" || (raw.batch.empty() && verify) ? BatchKind::Boundary
                                                                     : BatchKind::Random;
  const auto model = describe_model(o);
  if (!raw.preset.empty()) model->check_flags(/*preset=*/true);
  std::string tp = raw.tp;
  if (tp.empty()) tp = !verify ? "1" : model->default_verify_tp();
  o.tp = parse_tp_list(tp);
  o.dtype = raw.dtype.empty() ? default_dtype : parse_float_dtype(raw.dtype);
  // Ranges are checked by validate_run_options, with every other number.
  const auto min64 = std::numeric_limits<std::int64_t>::min();
  const auto max64 = std::numeric_limits<std::int64_t>::max();
  o.steps = raw.steps.empty() ? model->default_steps()
                              : parse_int_flag("--steps", raw.steps, min64, max64);
  if (!raw.batch_size.empty())
    o.batch_size = o.mlp.batch = parse_int_flag("--batch-size", raw.batch_size, min64, max64);
  o.seed = static_cast<std::uint64_t>(parse_int_flag("--seed", raw.seed, 0, max64));
  o.adam.lr = o.lr;
  o.adam.kind = *choice_named(kOptimizerNames, raw.optimizer);
  o.adam.schedule.decay_style = *choice_named(kLrDecayNames, raw.lr_decay_style);
  o.adam.decay_1d = raw.decay_params == "all";
  if (o.adam.schedule.decay_iters == 0) o.adam.schedule.decay_iters = o.steps;  // Megatron's
  o.fault = parse_fault(raw.fault);
  o.device.backend = parse_backend_kind(raw.backend);
  o.device.comm = parse_comm_kind(raw.comm);
  if (verify && raw.free_running && o.resync)
    throw UsageError("--resync and --free-running exclude each other");
  // In low precision a free-running trajectory leaves the reference within a few steps
  // (tolerance.cpp, "The update"): its bounds reach 1 and check nothing. So f32 and bf16
  // check every step from the reference's weights unless asked not to; f64 drifts by
  // reassociation only and runs free.
  if (verify && o.dtype != DType::F64 && !raw.free_running) o.resync = true;
  o.gpt.moe_micro_batches = o.dp;  // a replica's batch is a micro-batch
  // Every rank routes its own tokens (verify sets this per degree, when it runs several)
  o.gpt.moe_routing_ranks = o.dp * (o.tp.size() == 1 ? o.tp[0] : 1);
  try {
    validate_run_options(o);
  } catch (const UsageError& e) {
    // A size a Hugging Face config.json set (no flag may: apply_hf_checkpoint) is named
    // as the file names it, not as a flag the user never gave.
    if (!o.load_path.empty() && is_hf_model_dir(o.load_path))
      if (const std::string m = hf_config_message(o.load_path, o.gpt, e.what()); !m.empty())
        throw UsageError(m);
    throw;
  }
  // MPI starts once the options are known to be good, and only for a run of ranks.
  o.device.processes = start_processes(parse_launch_kind(raw.launch));
  say_so_when_the_launcher_ends_us(o.device);
}

// The command as typed, for the HTML page's header, quoted for a POSIX shell so that a
// pasted line runs exactly this command: a word of safe characters as it is, anything else
// in single quotes (a ' inside as '\''), and a word holding control bytes as $'...' with
// \xNN escapes (so no byte of it reaches the page raw).
std::string shell_word(const std::string& a) {
  static const std::string kSafe =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_@%+=:,./-";
  if (!a.empty() && a.find_first_not_of(kSafe) == std::string::npos) return a;
  bool control = false;
  for (char ch : a) control = control || static_cast<unsigned char>(ch) < 0x20 || ch == 0x7F;
  std::string out = control ? "$'" : "'";
  for (char ch : a) {
    const auto c = static_cast<unsigned char>(ch);
    if (control && (c < 0x20 || c == 0x7F || c == '\\' || c == '\'')) {
      static constexpr char kHex[] = "0123456789abcdef";
      out += std::string("\\x") + kHex[c >> 4] + kHex[c & 15];
    } else if (!control && c == '\'') {
      out += "'\\''";
    } else {
      out += ch;
    }
  }
  return out + "'";
}

std::string command_line(int argc, char** argv) {
  std::string s = "tpsim";
  for (int i = 1; i < argc; ++i) s += " " + shell_word(argv[i]);
  return s;
}

const char* kFooter = R"(
Exit codes: 0 pass, 1 verify found a mismatch, 2 bad input or usage, 3 runtime failure
(e.g. a collective timed out).)";

}  // namespace

int sweep_exit_code(const SweepReport& r) {
  if (r.first_failure()) return kExitMismatch;
  return r.errors() > 0 ? kExitRuntime : kExitOk;
}

int cli_main(int argc, char** argv) {
  CLI::App app{"tpsim: a tensor-parallel simulator and verifier. One process drives N ranks\n"
               "(threads) running a Megatron-style sharded model, and checks it element by\n"
               "element against an independent float64 Eigen reference."};
  app.footer(std::string(R"(
Examples:
  tpsim verify                                  # every model and mode, in seconds
  tpsim verify --model mlp --tp 1,2,4,8 --dtype f64
  tpsim train  --model mlp --tp 2 --steps 2
  tpsim verify --model mlp --tp 2 --inject-fault mlp-drop-f-backward   # must fail
  tpsim check --dumps DIR --load W.safetensors --data D.safetensors    # your own TP run
)") + kFooter);
  app.require_subcommand(1);
  app.option_defaults()->always_capture_default();  // --help shows every default

  RunOptions o;
  RawFlags raw;
  bool list_faults = false;

  auto* train = app.add_subcommand("train", "train the sharded model at one TP degree, printing "
                                            "what the seed prints per iteration");
  add_model_flags(*train, o, raw, false);
  add_tp_invariant_flag(*train, o, "");
  train->add_option("--save-final", o.save_final, "write the final full weights (safetensors)");
  train->add_option("--dump", o.dump_dir,
                    "gpt: write a dump of every rank's shards, every step, to this directory "
                    "(docs/dump-format.md), with the initial weights and the batch, for "
                    "`tpsim check`");
  train->add_option("--dump-steps-per-file", o.dump_steps_per_file,
                    "with --dump: steps per rank file (default: as many as fit 64 MiB and "
                    "16,384 tensors); a longer run is split into rank{r}.steps{a}-{b} files")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1'000'000'000}));
  train->footer(std::string(R"(
Examples:
  tpsim train --model mlp --tp 1
  tpsim train --model mlp --tp 2 --dtype f64 --steps 3)") + kFooter);

  auto* verify = app.add_subcommand("verify", "run the reference and the sharded model for each "
                                              "TP degree and compare every tensor, every step");
  add_model_flags(*verify, o, raw, true);
  add_tp_invariant_flag(*verify, o, "; each degree is then also compared with tp 1 bit for bit");
  verify->add_flag("--resync", o.resync,
                   "copy the reference weights into the shards before each step, so one "
                   "step's error is told from drift (the default for f32 and bf16)");
  verify->add_flag("--free-running", raw.free_running,
                   "f32 and bf16: let the sharded weights run free instead of restarting each "
                   "step from the reference's; the bounds grow with the weights' error, and "
                   "a bound of 1 or more is reported as no check");
  verify->add_option("--inject-fault", raw.fault,
                     "break the sharded model on purpose to see verify catch it "
                     "(--list-faults names them; mlp-sum-off-by-5e-11, a control within "
                     "float64's bound, must pass)");
  verify->add_option("--html", o.html_path,
                     "write a self-contained HTML page: losses, a heatmap of every tensor's "
                     "error per step and TP degree, the first failure's shards");
  verify->add_flag("--list-faults", list_faults, "list the faults --inject-fault knows and exit");
  std::string sweep = "pairs";
  verify->add_option("--sweep", sweep,
                     "without --model: pairs (the default: every pair of values of every two "
                     "feature axes meets in a case) or full (also every triple of the axes "
                     "that share collectives: longer)")
      ->check(CLI::IsMember({"pairs", "full"}));
  verify->footer(std::string(R"(
Examples:
  tpsim verify                                      # the default sweep: every model and mode
  tpsim verify --inject-fault gpt-missing-f         # ... with a bug it must catch
  tpsim verify --model mlp --tp 1,2,4,8 --dtype f64
  tpsim verify --model gpt --preset seed --loss-parallel --tp 1,2
  tpsim verify --model mlp --tp 2,4 --dtype f32 --steps 5 --json report.json
  tpsim verify --model gpt --preset small --steps 4 --inject-fault gpt-missing-g --html r.html

Without --model, verify runs the default sweep: the MLP at tp 1,2,4,8 and a small GPT (an
odd vocabulary, 12 heads) at tp 1,2,3,4, plain, loss parallel, sequence parallel and both,
each on a boundary batch and a random one, the families, recomputation, data parallelism
and MoE; then cases generated so that every pair of values of every two feature axes meets
in one (--sweep full: every triple of the collectives' axes too). --dtype, --steps,
--seed, --inject-fault, --timeout, --backend, --comm and --json apply to it.)") + kFooter);

  // profile: the train flags, a list of TP degrees, and where to write the trace and plot.
  ProfileOptions prof;
  auto* profile = app.add_subcommand("profile", "train at each TP degree with every op timed and "
                                                "every byte recorded; memory measured vs the "
                                                "analytical model, time per op and collective");
  add_model_flags(*profile, o, raw, true);
  add_tp_invariant_flag(*profile, o, "; profile it to see what the mode costs in time, "
                                     "memory and communication");
  profile->add_option("--trace", prof.trace_path,
                      "write a Chrome trace (Perfetto, chrome://tracing): one process per rank");
  profile->add_option("--html", prof.html_path, "write each rank's memory timeline as an HTML/SVG plot");
  profile->add_flag("--predict", prof.predict_only,
                    "print the analytical memory model's figures per rank and run nothing");
  profile->add_flag("--paper-table", prof.paper_table,
                    "print Korthikanti et al. 2022's activation memory per layer for its four "
                    "models (22B, 175B, 530B, 1T) beside tpsim's memory model, for TP, SP, "
                    "selective and full recomputation, and run nothing");
  profile->footer(std::string(R"(
Examples:
  tpsim profile --model gpt --tp 1,2 --steps 2
  tpsim profile --model gpt --tp 2 --loss-parallel --sequence-parallel --trace t.json
  tpsim profile --model gpt --tp 1,2 --tp-invariant   # its cost: compare with the run without it
  tpsim profile --model gpt2 --preset small --dropout 0.1 --recompute selective --tp 1,2
  tpsim profile --paper-table   # the recomputation paper's Table 2, beside tpsim's model)") + kFooter);

  CheckOptions chk;
  auto* check = app.add_subcommand(
      "check", "check a dump of someone else's TP training run (docs/dump-format.md) against "
               "the float64 reference, every tensor of every rank and step");
  check->add_option("--dumps", chk.dumps, "the dump directory: manifest.json, rank{r}.safetensors")
      ->required();
  check->add_option("--load", chk.load, "the full initial weights: safetensors in the dump's names, or a Hugging Face model directory (config.json must describe the dump's model)")
      ->required();
  check->add_option("--data", chk.data, "the batch: input_ids I64 [B,T], labels I64 [B,T-1]")
      ->required();
  check->add_option("--json", chk.json, "write a machine-readable report here");
  check->add_flag("--free-running", chk.free_running,
                  "run the reference on its own trajectory from the initial weights (errors "
                  "compound over steps) instead of starting each step from the dump's weights "
                  "of the step before");
  check->add_option("--html", chk.html,
                    "write a self-contained HTML page: losses, a tensor-by-step error heatmap, the "
                    "first failure's shards side by side");
  check->footer(R"(
Examples:
  tpsim train --model gpt --preset small --tp 2 --steps 2 --dump d
  tpsim check --dumps d --load d/weights.safetensors --data d/batch.safetensors

Exit codes: 0 pass, 1 a dumped tensor differs from the reference, 2 a bad dump or input
(one line naming the file, the tensor and the rank) or usage, 3 runtime failure.)");

  try {
    try {
      app.parse(argc, argv);
    } catch (const CLI::CallForHelp& e) {
      return app.exit(e);
    } catch (const CLI::CallForAllHelp& e) {
      return app.exit(e);
    } catch (const CLI::ParseError& e) {
      throw UsageError(e.what());
    }
    if (list_faults) {
      for (const auto& f : all_faults())
        if (f.fault != Fault::None && !f.scope.control)
          std::cout << f.name << "\t" << f.what << "\n";
      return kExitOk;
    }
    if (*check) {
      if (!chk.json.empty()) check_writable(chk.json, "--json");
      if (!chk.html.empty()) check_writable(chk.html, "--html");
      const CheckResult r = run_check(chk);
      // The directory as the reports show it: escaped and cut (it may hold any byte).
      const std::string dumps = escaped(chk.dumps);
      // --json -: the JSON is standard output, so the text report goes to stderr.
      print_check_report(chk.json == "-" ? std::cerr : std::cout, dumps, r.run, r.report);
      if (!chk.json.empty()) write_json(chk.json, check_json(dumps, r.run, r.report));
      if (!chk.html.empty())
        write_html_report(chk.html,
                          {"tpsim check", command_line(argc, argv), check_config_line(dumps, r.run),
                           tolerance_rule(r.report.tolerance, r.report.per_tensor_bounds),
                           check_verdict(r.report)},
                          r.report);
      return r.report.pass ? kExitOk : kExitMismatch;
    }
    // --load DIR of a Hugging Face checkpoint: its config.json names the family, so --model
    // may be left out (then verify runs that model, not the default sweep).
    bool model_from_checkpoint = false;
    for (const CLI::App* sub : {train, verify, profile})
      if (*sub && sub->count("--model") == 0 && !o.load_path.empty() && is_hf_model_dir(o.load_path)) {
        raw.model = checkpoint_family(read_hf_config(o.load_path));
        model_from_checkpoint = true;
      }
    if (*train) {
      apply_preset(*train, o, raw);
      finish_options(*train, o, raw, DType::F32, false);
      run_train(o, std::cout);
      return kExitOk;
    }
    if (*verify && verify->count("--model") == 0 && !model_from_checkpoint) {
      for (const char* flag : kSingleRunFlags)
        if (verify->count(flag) > 0)
          throw UsageError(std::string(flag) + " describes one configuration: add --model " +
                           gpt_family_list("or", "mlp") +
                           " (without --model, verify runs the default sweep)");
      if (raw.steps.empty()) raw.steps = "2";
      finish_options(*verify, o, raw, DType::F64, true);
      const SweepReport r = run_sweep(default_sweep(o, sweep == "full" ? 3 : 2));
      // Under MPI the first process checked every rank: it reports, and its verdict is all's.
      if (process_index(o.device) == 0) {
        print_sweep_report(o.json_path == "-" ? std::cerr : std::cout, o, r);  // --json -: stdout is the JSON
        if (!o.json_path.empty()) write_json(o.json_path, sweep_json(o, r));
      }
      return exit_code_of_first_process(o.device, sweep_exit_code(r));
    }
    if (*profile) {
      // Defaults: the seed's float32, one TP degree unless a list is given, 2 steps.
      if (raw.tp.empty()) raw.tp = "1";
      if (raw.steps.empty()) raw.steps = "2";
      apply_preset(*profile, o, raw);
      finish_options(*profile, o, raw, DType::F32, true);
      refuse_across_processes(o, "profile");
      if (raw.batch.empty()) o.batch = BatchKind::Random;  // profile times the seed's batch
      run_profile(o, prof, std::cout);
      return kExitOk;
    }
    if (verify->count("--sweep") > 0)
      throw UsageError("--sweep chooses the default sweep's cases, which runs without --model");
    apply_preset(*verify, o, raw);
    finish_options(*verify, o, raw, DType::F64, true);
    check_fault_applies(o.fault, fault_target(o));
    const VerifyReport r = run_verify(o);
    if (process_index(o.device) == 0) {
      print_verify_report(o.json_path == "-" ? std::cerr : std::cout, o, r);  // --json -: stdout is the JSON
      if (!o.json_path.empty()) write_verify_json(o.json_path, o, r);
      if (!o.html_path.empty())
        write_html_report(o.html_path,
                          {"tpsim verify", command_line(argc, argv), verify_config_line(o),
                           tolerance_rule(r.tolerance, r.per_tensor_bounds), verify_verdict(o, r)},
                          r);
    }
    return exit_code_of_first_process(o.device, r.pass ? kExitOk : kExitMismatch);
  } catch (const UsageError& e) {
    std::cerr << "tpsim: error: " << e.what() << "\n";
    return failed_with(kExitUsage, o.device);
  } catch (const std::bad_alloc&) {
    std::cerr << "tpsim: runtime failure: out of memory\n";
    return failed_with(kExitRuntime, o.device);
  } catch (const std::exception& e) {
    std::cerr << "tpsim: runtime failure: " << e.what() << "\n";
    return failed_with(kExitRuntime, o.device);
  }
}

}  // namespace tpsim
