// kmoe-generate --checkpoint FILE [--prompt TEXT | --prompt-ids I,J,...] [options]
// Samples continuations from a checkpoint's model (its own deck, /input/deck): the prompt runs
// through the model once, then one token at a time with a key/value cache per block, Engram
// recomputing only the window a new position reads and the MoE layers routing each token
// without a capacity (docs/INTEROP.md "Generation"). Greedy by default; --temperature with
// --top-k / --top-p samples from a counter-based generator seeded by --seed, so a sample is
// the same on every run and layout. Runs on the ranks it is launched on (a pipelined or
// expert-parallel layout included); every rank decodes the same sequence.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "core/device_sync.hpp"
#include "core/gemm.hpp"
#include "core/rng.hpp"
#include "drivers/driver_main.hpp"
#include "io/checkpoint.hpp"
#include "io/deck.hpp"
#include "io/hdf5_file.hpp"
#include "io/tokenizer.hpp"
#include "modules/model/stage.hpp"
#include "parallel/layer_comms.hpp"
#include "train/planner.hpp"

namespace {

const char* kUsage =
    "usage: kmoe-generate --checkpoint FILE [--prompt TEXT | --prompt-ids I,J,...]\n"
    "                     [--max-new-tokens N] [--max-context C] [--temperature T]\n"
    "                     [--top-k K] [--top-p P] [--seed S] [--samples N] [--check]\n"
    "                     [--dump-logits PREFIX] [--parallel.key=value ...]\n"
    "  continues the prompt (text through the byte-level ids of data.tokenizer = bytes, or\n"
    "  token ids) with up to N new tokens (default 64), stopping at the end-of-document id or\n"
    "  when the sequence fills C positions (default: the checkpoint's train.seq_len, the length\n"
    "  the model was trained on; beyond it RoPE extrapolates).\n"
    "  Greedy unless --temperature > 0, then sampled from the top-k (0: all) most likely ids\n"
    "  whose probabilities reach top-p (default 1), seeded by --seed (default 0); --samples\n"
    "  draws that many continuations (seeds S, S+1, ...). --check runs the whole final sequence\n"
    "  through the model again and requires its logits at every position within 1e-5 of the\n"
    "  incremental ones; --dump-logits writes PREFIX.ids.npy and PREFIX.logits.npy (the first\n"
    "  sample's positions). Computes in fp32 whatever the deck's train.precision.\n";

struct Options {
  std::string checkpoint, prompt, prompt_ids, dump;
  int max_new = 64, top_k = 0, samples = 1;
  int max_context = 0;  // 0: train.seq_len
  double temperature = 0.0, top_p = 1.0;
  std::uint64_t seed = 0;
  bool check = false;
  std::vector<std::string> overrides;
};

template <class T>
T number(const std::string& flag, const std::string& text) {
  std::istringstream in(text);
  T v{};
  in >> v;
  KMOE_REQUIRE(in && in.peek() == EOF, flag << " " << text << ": not a number");
  return v;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    const bool has_value = i + 1 < argc;
    auto value = [&]() -> std::string { return argv[++i]; };
    if (s == "--checkpoint" && has_value) {
      o.checkpoint = value();
    } else if (s == "--prompt" && has_value) {
      o.prompt = value();
    } else if (s == "--prompt-ids" && has_value) {
      o.prompt_ids = value();
    } else if (s == "--max-new-tokens" && has_value) {
      o.max_new = number<int>(s, value());
    } else if (s == "--max-context" && has_value) {
      o.max_context = number<int>(s, value());
    } else if (s == "--temperature" && has_value) {
      o.temperature = number<double>(s, value());
    } else if (s == "--top-k" && has_value) {
      o.top_k = number<int>(s, value());
    } else if (s == "--top-p" && has_value) {
      o.top_p = number<double>(s, value());
    } else if (s == "--seed" && has_value) {
      o.seed = number<std::uint64_t>(s, value());
    } else if (s == "--samples" && has_value) {
      o.samples = number<int>(s, value());
    } else if (s == "--dump-logits" && has_value) {
      o.dump = value();
    } else if (s == "--check") {
      o.check = true;
    } else if (s.rfind("--", 0) == 0 && s.find('.') != std::string::npos) {
      o.overrides.push_back(s);
    } else {
      KMOE_FAIL("unknown argument '" << s << "'\n" << kUsage);
    }
  }
  KMOE_REQUIRE(!o.checkpoint.empty(), "need --checkpoint\n" << kUsage);
  KMOE_REQUIRE(o.max_new >= 1, "--max-new-tokens " << o.max_new << ": at least 1");
  KMOE_REQUIRE(o.max_context >= 0, "--max-context " << o.max_context << ": at least 1 (0: "
                                                    << "the checkpoint's train.seq_len)");
  KMOE_REQUIRE(o.temperature >= 0, "--temperature " << o.temperature << ": not negative");
  KMOE_REQUIRE(o.top_k >= 0, "--top-k " << o.top_k << ": not negative (0: every id)");
  KMOE_REQUIRE(o.top_p > 0 && o.top_p <= 1, "--top-p " << o.top_p << ": in (0, 1]");
  KMOE_REQUIRE(o.samples >= 1, "--samples " << o.samples << ": at least 1");
  return o;
}

// The prompt's ids: --prompt-ids as given, or --prompt's bytes under the byte-level ids.
std::vector<std::int32_t> prompt_ids(const Options& o, const kmoe::Config& cfg) {
  KMOE_REQUIRE(o.prompt.empty() != o.prompt_ids.empty(),
               "give the prompt as --prompt TEXT or as --prompt-ids I,J,... (one of them)");
  std::vector<std::int32_t> ids;
  if (!o.prompt_ids.empty()) {
    std::stringstream in(o.prompt_ids);
    std::string item;
    while (std::getline(in, item, ',')) {
      const int id = number<int>("--prompt-ids", item);
      KMOE_REQUIRE(id >= 0 && id < cfg.model.vocab_size,
                   "--prompt-ids: " << id << " is outside the vocabulary [0, "
                                    << cfg.model.vocab_size << ")");
      ids.push_back(id);
    }
  } else {
    KMOE_REQUIRE(cfg.data.tokenizer != kmoe::Tokenizer::External,
                 "--prompt TEXT: the checkpoint's data.tokenizer = external (another tool's ids); "
                 "give --prompt-ids");
    ids = kmoe::deck_tokenizer(cfg.data)->encode(o.prompt);
    for (std::int32_t id : ids)
      KMOE_REQUIRE(id < cfg.model.vocab_size, "--prompt: the tokenizer gives id "
                                                  << id << ", outside model.vocab_size "
                                                  << cfg.model.vocab_size);
  }
  KMOE_REQUIRE(!ids.empty(), "the prompt is empty");
  return ids;
}

// The next id from one row of logits: the most likely (the lowest id among equals) when
// greedy; else drawn at temperature from the top-k ids whose probabilities reach top-p, with
// one counter-based uniform number for (seed, sample, step).
int next_id(const std::vector<float>& logits, const Options& o, std::uint64_t key) {
  const int V = static_cast<int>(logits.size());
  if (o.temperature == 0.0)
    return static_cast<int>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  std::vector<int> order(V);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return logits[a] > logits[b]; });
  const int keep = o.top_k > 0 ? std::min(o.top_k, V) : V;
  std::vector<double> p(keep);
  const double top = logits[order[0]] / o.temperature;
  double sum = 0.0;
  for (int i = 0; i < keep; ++i) sum += p[i] = std::exp(logits[order[i]] / o.temperature - top);
  int n = 0;
  double mass = 0.0;
  while (n < keep && (n == 0 || mass < o.top_p * sum)) mass += p[n++];
  const double u = kmoe::uniform_open01(kmoe::splitmix64(key)) * mass;
  double acc = 0.0;
  for (int i = 0; i < n; ++i)
    if ((acc += p[i]) >= u) return order[i];
  return order[n - 1];
}

// A .npy file (format 1.0) of `data`, shape `shape`, dtype '<f4' or '<i4'.
template <class T>
void write_npy(const std::string& path, const std::vector<T>& data,
               const std::vector<std::int64_t>& shape, const char* descr) {
  std::ostringstream h;
  h << "{'descr': '" << descr << "', 'fortran_order': False, 'shape': (";
  for (std::int64_t d : shape) h << d << ", ";
  h << "), }";
  std::string header = h.str();
  header.append(63 - (10 + header.size()) % 64, ' ');
  header += '\n';
  std::ofstream out(path, std::ios::binary);
  out.write("\x93NUMPY\x01\x00", 8);
  const std::uint16_t len = static_cast<std::uint16_t>(header.size());
  out.put(char(len & 0xFF));
  out.put(char(len >> 8));
  out << header;
  out.write(reinterpret_cast<const char*>(data.data()), std::streamsize(data.size() * sizeof(T)));
  out.close();
  KMOE_REQUIRE(!out.fail(), path << ": cannot write");
}

// Runs positions [pos, pos + n) of `ids` through the pipeline: each stage decodes, the next
// receives its output; returns the last stage's logits on the host (empty elsewhere).
std::vector<float> decode_through(kmoe::Stage& stage, const kmoe::TensorTable& table,
                                  const kmoe::ProcessGrid& grid, const std::int32_t* ids, int pos,
                                  int n, kmoe::DecodeCache& cache, int D, int V) {
  const kmoe::DataComm& pipe = grid.data_plane(grid.pipe);
  if (!grid.first_stage()) pipe.recv(stage.input_buffer(), std::int64_t(n) * D, grid.pp_rank - 1);
  const kmoe::ConstMat logits = stage.decode(table, ids, pos, n, cache);
  if (!grid.last_stage()) {
    kmoe::Pending p = pipe.start_send(stage.output(), std::int64_t(n) * D, grid.pp_rank + 1);
    pipe.complete(p);
    return {};
  }
  auto h = kmoe::read_to_host("generate logits", logits);
  std::vector<float> out(std::size_t(n) * V);
  for (int r = 0; r < n; ++r)
    for (int j = 0; j < V; ++j) out[std::size_t(r) * V + j] = h(r, j);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  return kmoe::run_driver(argc, argv, "kmoe-generate", kUsage, [](int argc, char** argv, const kmoe::ExecutionPlan& exec) {
    const Options o = parse(argc, argv);
    // 1. The model: the checkpoint's deck, on the launch's ranks.
    std::string deck_text;
    {
      const kmoe::H5File f = kmoe::H5File::open(o.checkpoint, MPI_COMM_SELF);
      KMOE_REQUIRE(f.has_attr("/input", "deck"),
                   o.checkpoint << ": not a kmoe checkpoint (no /input deck attribute)");
      deck_text = f.attr_string("/input", "deck");
    }
    int ranks = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);
    std::string note;
    const kmoe::Config cfg = kmoe::launch_layout(
        [&](const std::vector<std::string>& over) {
          return kmoe::parse_deck(deck_text, o.checkpoint + ":/input/deck", over);
        },
        o.overrides, ranks, &note);
    kmoe::ProcessGrid grid(cfg.parallel, cfg.model.n_layers, MPI_COMM_WORLD);
    const bool root = grid.is_root();
    if (root && !note.empty()) std::printf("note: %s\n", note.c_str());
    const std::vector<std::int32_t> prompt = prompt_ids(o, cfg);
    const int P = static_cast<int>(prompt.size()), D = cfg.model.d_model, V = cfg.model.vocab_size;
    const int context = o.max_context > 0 ? o.max_context : cfg.train.seq_len;
    const char* context_from = o.max_context > 0 ? "--max-context" : "train.seq_len";
    KMOE_REQUIRE(P < context, "the prompt has " << P << " ids, which leaves no room in a context of "
                                                << context << " positions (" << context_from
                                                << (o.max_context > 0 ? "" : " of the checkpoint; "
                                                                             "--max-context raises it")
                                                << ")");
    const int max_new = static_cast<int>(std::min<std::int64_t>(o.max_new, context - P));
    if (root && max_new < o.max_new)
      std::printf("note: --max-new-tokens %d: a sequence stops at %d positions (%s%s), so at most "
                  "%d new tokens follow the %d of the prompt\n",
                  o.max_new, context, context_from,
                  o.max_context > 0 ? "" : ", the length the model was trained on; --max-context "
                                           "raises it",
                  max_new, P);
    const int capacity = P + max_new;
    const int eod = cfg.data.end_of_document(V);
    // The samples' text through the checkpoint's SentencePiece model (loaded once), if it has one.
    const auto sentencepiece = root && cfg.data.tokenizer == kmoe::Tokenizer::SentencePiece
                                   ? kmoe::deck_tokenizer(cfg.data)
                                   : nullptr;

    // 2. One sequence at a time, fp32, every MoE layer without a capacity.
    const kmoe::RunContext ctx = kmoe::make_run_context(kmoe::Precision::Fp32, exec.batch_threads);
    kmoe::MoeCfg dropless = cfg.moe;
    dropless.capacity_factor = 0.0;
    const kmoe::StagePlan plan = kmoe::StagePlan::of(grid);
    const kmoe::LayerComms comms = kmoe::layer_comms(cfg, grid);
    kmoe::TensorTable table;
    std::optional<kmoe::Stage> built;
    try {  // the buffers of `capacity` positions (attention's grow with its square)
      built.emplace(ctx, cfg.model, dropless, 1, capacity, table, cfg.engram, plan, comms);
      table.allocate();
    } catch (const kmoe::Error&) {
      throw;
    } catch (const std::exception& e) {  // Kokkos' allocation failure (bad_alloc or runtime_error)
      KMOE_FAIL("a sequence of " << capacity << " positions (the prompt's " << P
                                 << " and --max-new-tokens " << max_new
                                 << ") needs more memory than there is: " << e.what()
                                 << "\nask for fewer positions (--max-new-tokens, --max-context)");
    }
    kmoe::Stage& stage = *built;
    const kmoe::TrainState state =
        kmoe::load_checkpoint(o.checkpoint, cfg, grid, table, /*with_optimizer=*/false, nullptr);
    const int sampler = (grid.pp - 1) * grid.dp * grid.ep;  // world rank: last stage, replica 0

    std::vector<std::int32_t> first_ids;
    std::vector<float> first_logits;  // the first sample's positions (last stage)
    const auto t0 = std::chrono::steady_clock::now();
    std::int64_t generated = 0;
    for (int s = 0; s < o.samples; ++s) {
      std::vector<std::int32_t> ids = prompt;
      kmoe::DecodeCache cache = stage.new_decode_cache();
      std::vector<float> logits = decode_through(stage, table, grid, ids.data(), 0, P, cache, D, V);
      std::vector<float> all = logits;
      for (int step = 0; step < max_new; ++step) {
        int next = 0;
        if (grid.world.rank() == sampler) {  // the last position's logits
          const std::vector<float> row(logits.end() - V, logits.end());
          next = next_id(row, o, o.seed + std::uint64_t(s) * 0x9E3779B97F4A7C15ull +
                                     std::uint64_t(step) * 0xD1B54A32D192ED03ull);
        }
        MPI_Bcast(&next, 1, MPI_INT, sampler, grid.world.comm());
        ids.push_back(next);
        if (next == eod || step + 1 == max_new) break;
        const int pos = static_cast<int>(ids.size()) - 1;
        logits = decode_through(stage, table, grid, ids.data() + pos, pos, 1, cache, D, V);
        all.insert(all.end(), logits.begin(), logits.end());
      }
      generated += static_cast<std::int64_t>(ids.size()) - P;
      if (s == 0) {
        first_ids = ids;
        first_logits = all;
      }
      if (root) {  // the text, end-of-document ids left out (a prompt may start with one)
        std::string text;
        if (sentencepiece) {
          text = sentencepiece->decode(ids);
        } else {
          for (std::int32_t id : ids) {
            if (id == eod) continue;
            text += cfg.data.tokenizer == kmoe::Tokenizer::Bytes && id < 256
                        ? std::string(1, char(id))
                        : "<" + std::to_string(id) + ">";
          }
        }
        std::printf("sample %d (%zu new tokens%s):\n%s\n", s, ids.size() - P,
                    ids.back() == eod                   ? ", ended the document"
                    : int(ids.size()) == context        ? ", filled the context"
                                                        : "",
                    text.c_str());
        std::fflush(stdout);
      }
    }

    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    // 3. The positions the model read for the first sample (all but its last id) once more,
    // whole: the logits at every position against the incremental ones.
    const int L = static_cast<int>(first_ids.size()) - 1;
    if (o.check) {
      kmoe::Stage whole(ctx, cfg.model, dropless, 1, L, table, cfg.engram, plan, comms);
      whole.keep_logits();
      const kmoe::DataComm& pipe = grid.data_plane(grid.pipe);
      if (!grid.first_stage())
        pipe.recv(whole.input_buffer(), std::int64_t(L) * D, grid.pp_rank - 1);
      whole.forward(table, first_ids.data(), 1, 0.0f);
      double worst = 0.0, scale = 0.0;
      if (!grid.last_stage()) {
        kmoe::Pending p = pipe.start_send(whole.output(), std::int64_t(L) * D, grid.pp_rank + 1);
        pipe.complete(p);
      } else {
        auto h = kmoe::read_to_host("generate check", whole.last_logits());
        for (int r = 0; r < L; ++r)
          for (int j = 0; j < V; ++j) {
            const double full = h(r, j), inc = first_logits[std::size_t(r) * V + j];
            worst = std::max(worst, std::abs(full - inc));
            scale = std::max(scale, std::abs(full));
          }
      }
      double verdict[2] = {worst, scale};
      MPI_Bcast(verdict, 2, MPI_DOUBLE, sampler, grid.world.comm());
      const double rel = verdict[0] / std::max(verdict[1], 1.0);
      if (root)
        std::printf("check: logits at %d positions, largest |incremental - whole| %.3g "
                    "(%.3g of the largest logit, tolerance 1e-5)\n",
                    L, verdict[0], rel);
      KMOE_REQUIRE(rel <= 1e-5, "check: the incremental logits differ from the whole sequence's "
                                    "by " << rel << " of the largest logit (tolerance 1e-5)");
    }
    if (!o.dump.empty() && grid.world.rank() == sampler) {
      write_npy(o.dump + ".ids.npy", std::vector<std::int32_t>(first_ids.begin(),
                                                               first_ids.begin() + L),
                {L}, "<i4");
      write_npy(o.dump + ".logits.npy", first_logits, {L, V}, "<f4");
    }
    if (root)
      std::printf("generated %lld tokens from %s (step %d) in %.2f s (%.0f tokens/s, prompts "
                  "included) on %d rank(s): pp %d, dp %d, ep %d\n",
                  (long long)generated, o.checkpoint.c_str(), state.step, secs, generated / secs,
                  ranks, grid.pp, grid.dp, grid.ep);
  });
}
