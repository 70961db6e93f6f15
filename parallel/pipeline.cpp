#include "parallel/pipeline.h"

#include <algorithm>
#include <limits>
#include <map>
#include <sstream>

#include "core/check.h"

namespace trainer::parallel {

namespace {

bool contains(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

void check_counts(size_t blocks, int stages, int chunks) {
  if (stages < 1 || chunks < 1)
    throw Error(cat("a pipeline of ", stages, " stages x ", chunks, " chunks"));
  if (size_t(stages) * size_t(chunks) > blocks)
    throw Error(cat("the model has ", blocks, " blocks, fewer than the ", stages * chunks,
                    " pipeline pieces (parallel.pp x parallel.virtual_stages) asked for; each "
                    "piece needs at least one block"));
}

}  // namespace

StageSplit even_split(size_t blocks, int stages, int chunks) {
  check_counts(blocks, stages, chunks);
  StageSplit s{.stages = stages, .chunks = chunks, .bounds = {0}};
  const size_t n = size_t(s.pieces());
  for (size_t v = 0; v < n; ++v)
    s.bounds.push_back(s.bounds.back() + blocks / n + (v < blocks % n));
  return s;
}

StageSplit split_at(size_t blocks, int stages, int chunks, const std::vector<int64_t>& starts) {
  check_counts(blocks, stages, chunks);
  StageSplit s{.stages = stages, .chunks = chunks, .bounds = {0}};
  if (starts.size() + 1 != size_t(s.pieces()))
    throw Error(cat("parallel.stages lists ", starts.size(), " block boundaries; ", s.pieces(),
                    " pieces need ", s.pieces() - 1,
                    " (the first block of every piece after the "
                    "first)"));
  for (int64_t b : starts) {
    if (b <= int64_t(s.bounds.back()) || b >= int64_t(blocks))
      throw Error(cat("parallel.stages: boundary ", b, " is not between ", s.bounds.back() + 1,
                      " and ", blocks - 1,
                      " (boundaries increase, and every piece holds at least one of the ", blocks,
                      " blocks)"));
    s.bounds.push_back(size_t(b));
  }
  s.bounds.push_back(blocks);
  return s;
}

StageSplit balanced_split(const std::vector<double>& cost, const std::vector<double>& memory,
                          double memory_limit, int stages, int chunks) {
  const size_t n = cost.size();
  check_counts(n, stages, chunks);
  CHECK_EQ(memory.size(), n);
  const size_t k = size_t(stages) * size_t(chunks);
  std::vector<double> c(n + 1, 0), m(n + 1, 0);
  for (size_t i = 0; i < n; ++i) {
    c[i + 1] = c[i] + cost[i];
    m[i + 1] = m[i] + memory[i];
  }
  const double inf = std::numeric_limits<double>::infinity();
  // best[j][i]: the smallest largest cost of j pieces over blocks [0, i).
  std::vector<std::vector<double>> best(k + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<size_t>> cut(k + 1, std::vector<size_t>(n + 1, 0));
  best[0][0] = 0;
  for (size_t j = 1; j <= k; ++j)
    for (size_t i = j; i <= n; ++i)
      for (size_t p = j - 1; p < i; ++p) {
        if (best[j - 1][p] == inf) continue;
        if (memory_limit > 0 && m[i] - m[p] > memory_limit) continue;
        const double v = std::max(best[j - 1][p], c[i] - c[p]);
        if (v < best[j][i]) {
          best[j][i] = v;
          cut[j][i] = p;
        }
      }
  if (best[k][n] == inf)
    throw Error(cat("no split of the ", n, " blocks into ", k,
                    " pipeline pieces keeps every piece within the memory limit of ",
                    memory_limit / double(1 << 20),
                    " MiB (parallel.stage_memory_mb): raise it or add stages"));
  StageSplit s{.stages = stages, .chunks = chunks, .bounds = std::vector<size_t>(k + 1)};
  s.bounds[k] = n;
  for (size_t j = k, i = n; j > 0; --j) {
    i = cut[j][i];
    s.bounds[j - 1] = i;
  }
  return s;
}

std::string to_string(const StageSplit& split) {
  std::ostringstream out;
  for (size_t v = 0; v + 1 < split.bounds.size(); ++v)
    out << (v ? " " : "") << "[" << split.bounds[v] << ", " << split.bounds[v + 1] << ")";
  return out.str();
}

PipelinePlan::PipelinePlan(const BlockList& blocks, StageSplit split) : split_(std::move(split)) {
  CHECK_EQ(split_.bounds.size(), size_t(split_.pieces()) + 1);
  CHECK(split_.bounds.front() == 0 && split_.bounds.back() == blocks.size())
      << "a split of " << to_string(split_) << " for " << blocks.size() << " blocks";
  const std::vector<std::string>& model_inputs = blocks.boundary(0);
  const std::vector<std::string>& model_outputs = blocks.boundary(blocks.size());
  auto carried = [&](const std::string& n) {
    return contains(model_inputs, n) && contains(model_outputs, n);
  };
  auto writes = [&](size_t b, const std::string& n) { return contains(blocks[b].outputs, n); };
  auto reads = [&](size_t b, const std::string& n) { return contains(blocks[b].inputs, n); };
  std::vector<int> piece_of_block(blocks.size());
  for (int v = 0; v < split_.pieces(); ++v)
    for (size_t b = split_.bounds[size_t(v)]; b < split_.bounds[size_t(v) + 1]; ++b)
      piece_of_block[b] = v;
  const int last_piece = split_.pieces() - 1;

  pieces_.resize(size_t(split_.pieces()));
  std::map<std::tuple<std::string, int, int>, int> transfer_index;
  for (int v = 0; v < split_.pieces(); ++v) {
    Piece& p = pieces_[size_t(v)];
    p.first = split_.bounds[size_t(v)];
    p.last = split_.bounds[size_t(v) + 1];
    for (const std::string& n : blocks.boundary(p.first)) {
      // Read here before this piece writes it, or a model output the loss needs.
      bool needed = false;
      for (size_t b = p.first; b < p.last && !needed; ++b) {
        if (reads(b, n)) needed = true;
        if (writes(b, n)) break;
      }
      bool written_here = false;
      for (size_t b = p.first; b < p.last; ++b) written_here = written_here || writes(b, n);
      if (v == last_piece && !written_here && contains(model_outputs, n) && !carried(n))
        needed = true;
      if (!needed) {
        p.input_source.push_back(Piece::kAbsent);
        continue;
      }
      int producer = -1;
      for (size_t b = p.first; b-- > 0;)
        if (writes(b, n)) {
          producer = piece_of_block[b];
          break;
        }
      if (producer < 0) {
        p.input_source.push_back(Piece::kModelInput);
        continue;
      }
      auto [it, added] =
          transfer_index.emplace(std::make_tuple(n, producer, v), int(transfers_.size()));
      if (added) transfers_.push_back(Transfer{.name = n, .from = producer, .to = v});
      p.input_source.push_back(it->second);
      p.receives.push_back(it->second);
    }
  }
  for (int v = 0; v < split_.pieces(); ++v) {
    Piece& p = pieces_[size_t(v)];
    for (const std::string& n : blocks.boundary(p.last)) {
      std::vector<int> out;
      for (size_t t = 0; t < transfers_.size(); ++t)
        if (transfers_[t].from == v && transfers_[t].name == n) {
          out.push_back(int(t));
          p.sends.push_back(int(t));
        }
      bool written_here = false;
      for (size_t b = p.first; b < p.last; ++b) written_here = written_here || writes(b, n);
      p.output_kept.push_back(contains(model_outputs, n) &&
                              (carried(n) ? written_here : v == last_piece));
      p.output_transfers.push_back(std::move(out));
    }
    std::sort(p.sends.begin(), p.sends.end());
  }
}

std::vector<std::pair<size_t, size_t>> PipelinePlan::blocks_of_stage(int stage) const {
  std::vector<std::pair<size_t, size_t>> out;
  for (int c = 0; c < split_.chunks; ++c) {
    const Piece& p = pieces_[size_t(split_.piece(stage, c))];
    out.push_back({p.first, p.last});
  }
  return out;
}

namespace {

// A node of StageModule's name tree.
class Container : public Module {
 public:
  Tensor forward(const Tensor&) override {
    CHECK(false) << "a pipeline stage's parameter container has no forward";
    return {};
  }
  // The child `name`, made when absent.
  Module& child(const std::string& name) {
    for (const auto& [n, m] : children())
      if (n == name) return *m;
    return *register_module(name, std::make_shared<Container>());
  }
  void add(const std::string& name, std::shared_ptr<Module> m) {
    for (const auto& [n, existing] : children())
      if (n == name) {
        CHECK(existing == m) << "two modules under the name '" << name << "'";
        return;
      }
    register_module(name, std::move(m));
  }
  // A module part's parameters, under this node's name for them (the parts
  // of one module, e.g. an LSTM's layers, meet here).
  void add_part(const ModulePart& part) {
    for (const NamedTensor& p : part.named_parameters()) register_parameter(p.name, p.tensor);
  }
};

}  // namespace

StageModule::StageModule(const BlockList& blocks,
                         const std::vector<std::pair<size_t, size_t>>& ranges) {
  auto root = std::make_shared<Container>();
  for (const auto& [first, last] : ranges)
    for (size_t b = first; b < last; ++b)
      for (const BlockMember& m : blocks[b].members) {
        Container* node = root.get();
        std::string rest = m.prefix;
        for (size_t dot; (dot = rest.find('.')) != std::string::npos; rest = rest.substr(dot + 1))
          node = static_cast<Container*>(&node->child(rest.substr(0, dot)));
        if (const auto* part = dynamic_cast<const ModulePart*>(m.module.get()))
          static_cast<Container&>(node->child(rest)).add_part(*part);
        else
          node->add(rest, m.module);
      }
  for (const auto& [name, child] : root->children()) register_module(name, child);
}

Tensor StageModule::forward(const Tensor&) {
  CHECK(false) << "a pipeline stage runs its blocks through the plan, not forward()";
  return {};
}

}  // namespace trainer::parallel
