// Models as block lists (layers/block_list.h): for every model of the
// registry, running its blocks is bit for bit the forward written out by hand
// from its layers (outputs and gradients), cutting the list at any boundary
// and running the two slices gives the same bits, and the blocks' parameters
// are exactly the model's, in state_dict order. Also: liveness across
// boundaries (a long skip connection, the LSTM's carried state), the tied
// GPT head, and the errors of a malformed list.
#include "tests/testing.h"

#include <map>
#include <set>

#include "layers/block_list.h"
#include "layers/conv.h"
#include "layers/init.h"
#include "layers/pooling.h"
#include "layers/tensor_parallel.h"
#include "models/gpt.h"
#include "models/lstm_lm.h"
#include "models/registry.h"
#include "models/resnet.h"
#include "models/small.h"

using namespace trainer;
using namespace trainer::testing;

namespace {

Module& child(const Module& m, const std::string& name) {
  for (const auto& [n, c] : m.children())
    if (n == name) return *c;
  FAIL("no child " << name);
  throw 0;
}

template <class M>
M& child_as(const Module& m, const std::string& name) {
  auto* c = dynamic_cast<M*>(&child(m, name));
  REQUIRE(c != nullptr);
  return *c;
}

// The forwards as the models wrote them before they were block lists.
Tensor resnet_by_hand(ResNet& net, const Tensor& x) {
  Tensor y = conv_bn(child_as<Conv2d>(net, "conv1"), child_as<BatchNorm2d>(net, "bn1"), x, true);
  if (!net.options().small_input)
    y = MaxPool2d(Pool2dAttrs{.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}})(y);
  for (const char* layer : {"layer1", "layer2", "layer3", "layer4"}) y = child(net, layer)(y);
  return child(net, "fc")(AdaptiveAvgPool2d(1, 1)(y).flatten(1));
}

Tensor small_cnn_by_hand(Model& net, const Tensor& x) {
  MaxPool2d pool{Pool2dAttrs{}};
  Tensor y =
      pool(conv_bn(child_as<Conv2d>(net, "conv1"), child_as<BatchNorm2d>(net, "bn1"), x, true));
  y = pool(conv_bn(child_as<Conv2d>(net, "conv2"), child_as<BatchNorm2d>(net, "bn2"), y, true));
  y = relu(child(net, "fc1")(y.flatten(1)));
  return child(net, "fc2")(child(net, "dropout")(y));
}

Tensor mlp_by_hand(Model& net, const Tensor& x) {
  Tensor y = x.flatten(1);
  const size_t n = net.children().size();
  for (size_t i = 0; i < n; ++i) {
    y = (*net.children()[i].second)(y);
    if (i + 1 < n) y = relu(y);
  }
  return y;
}

Tensor gpt_by_hand(GPT& gpt, const Tensor& tokens) {
  Tensor pos = arange(tokens.size(1), DType::i64, tokens.device());
  Tensor x = (*gpt.drop)((*gpt.wte)(tokens) + (*gpt.wpe)(pos));
  for (const auto& b : gpt.h) x = (*b)(x);
  return linear((*gpt.ln_f)(x), gpt.lm_head_weight(), Tensor());
}

// in: tokens, h0, c0, h1, c1, .. [B, H]; out: logits, h0, c0, ..
TensorList lstm_by_hand(LSTMLM& lm, const TensorList& in) {
  Tensor x = (*lm.drop)((*lm.encoder)(in[0]));
  TensorList hs, cs;
  for (size_t k = 1; k < in.size(); k += 2) {
    hs.push_back(in[k]);
    cs.push_back(in[k + 1]);
  }
  auto [y, next] = lm.rnn->forward(x, RNNState{stack(hs, 0), stack(cs, 0)});
  Tensor bias;
  for (const NamedTensor& p : lm.named_parameters())
    if (p.name == "decoder.bias") bias = p.tensor;
  TensorList out = {linear((*lm.drop)(y), lm.decoder_weight(), bias)};
  for (int64_t k = 0; k < next.h.size(0); ++k) {
    out.push_back(next.h.select(0, k));
    out.push_back(next.c.select(0, k));
  }
  return out;
}

using Forward = std::function<TensorList(const TensorList&)>;

struct Run {
  TensorList outputs;
  std::map<std::string, Tensor> grads;
};

// Outputs of f and the parameters' gradients of sum_k sum(outputs[k] * probe_k).
Run run_with_grads(Module& model, const Forward& f, const TensorList& inputs) {
  model.zero_grad();
  Run r;
  r.outputs = f(inputs);
  Tensor loss;
  for (size_t k = 0; k < r.outputs.size(); ++k) {
    Tensor term = sum(r.outputs[k] * probe_like(r.outputs[k], 100 + k));
    loss = loss.defined() ? loss + term : term;
  }
  loss.backward();
  for (const NamedTensor& p : model.named_parameters()) {
    INFO(p.name);
    REQUIRE(p.tensor.grad().defined());
    r.grads[p.name] = p.tensor.grad().clone();
  }
  model.zero_grad();
  return r;
}

void require_same_run(const Run& a, const Run& b, const std::string& what) {
  REQUIRE(a.outputs.size() == b.outputs.size());
  for (size_t k = 0; k < a.outputs.size(); ++k)
    require_close(a.outputs[k], b.outputs[k], 0.0, 0.0, cat(what, ": output ", k));
  REQUIRE(a.grads.size() == b.grads.size());
  for (const auto& [name, g] : a.grads)
    require_close(g, b.grads.at(name), 0.0, 0.0, what + ": " + name);
}

std::vector<std::string> names_of(const std::vector<NamedTensor>& ts) {
  std::vector<std::string> out;
  for (const NamedTensor& t : ts) out.push_back(t.name);
  return out;
}

// Blocks against the hand-written forward, every two-slice cut, and the
// blocks' parameters against the model's.
void check_model(Model& model, const Forward& by_hand, const TensorList& inputs) {
  const BlockList& blocks = model.blocks();
  REQUIRE(blocks.size() >= 2);
  CHECK(names_of(blocks.state(0, blocks.size())) == names_of(model.state()));
  CHECK(names_of(blocks.named_parameters(0, blocks.size())) == names_of(model.named_parameters()));

  const Run reference = run_with_grads(model, by_hand, inputs);
  const Run whole = run_with_grads(
      model, [&](const TensorList& in) { return blocks.run(in); }, inputs);
  require_same_run(whole, reference, "blocks vs by hand");
  for (size_t cut = 1; cut < blocks.size(); ++cut) {
    INFO("cut before block " << cut << " (" << blocks[cut].name << ")");
    const Run sliced = run_with_grads(
        model,
        [&](const TensorList& in) {
          TensorList mid = blocks.run(0, cut, in);
          REQUIRE(mid.size() == blocks.boundary(cut).size());
          return blocks.run(cut, blocks.size(), mid);
        },
        inputs);
    require_same_run(sliced, reference, cat("cut at ", cut));
  }
}

Tensor images(int64_t n, int64_t c, int64_t side) {
  Generator gen(5);
  return rand_tensor({n, c, side, side}, gen);
}

Tensor tokens(int64_t B, int64_t T, int64_t V) {
  std::vector<int64_t> t(size_t(B * T));
  for (size_t i = 0; i < t.size(); ++i) t[i] = int64_t((7 * i + 3) % size_t(V));
  return from_vector(t, {B, T});
}

}  // namespace

TEST_CASE("blocks: every ResNet runs bit for bit as its hand-written forward", "[models][blocks]") {
  for (const char* name : {"resnet18", "resnet50_small"}) {
    INFO(name);
    auto net = std::dynamic_pointer_cast<ResNet>(
        make_model(name, {.num_classes = 7, .in_channels = 3, .width = 4}));
    REQUIRE(net);
    check_model(*net, [&](const TensorList& in) { return TensorList{resnet_by_hand(*net, in[0])}; },
                {images(2, 3, 32)});
    const BlockList& b = net->blocks();
    CHECK(b[0].name == "stem");
    CHECK(b[1].name == "layer1.0");
    CHECK(b[b.size() - 1].name == "head");
    CHECK(b.boundary(3) == std::vector<std::string>{"x"});
    CHECK(b.boundary(b.size()) == std::vector<std::string>{"logits"});
    CHECK(b.tied().empty());
  }
}

TEST_CASE("blocks: small CNN and MLP run bit for bit as their hand-written forwards",
          "[models][blocks]") {
  auto cnn = make_model("small_cnn",
                        {.num_classes = 10, .in_channels = 1, .image_size = 8, .dropout = 0.0});
  check_model(*cnn,
              [&](const TensorList& in) { return TensorList{small_cnn_by_hand(*cnn, in[0])}; },
              {images(3, 1, 8)});
  auto mlp = make_model("mlp", {.num_classes = 10, .in_channels = 1, .image_size = 8});
  check_model(*mlp, [&](const TensorList& in) { return TensorList{mlp_by_hand(*mlp, in[0])}; },
              {images(3, 1, 8)});
  CHECK(mlp->blocks().size() == 3);
}

TEST_CASE("blocks: GPT runs bit for bit as its hand-written forward, tied or not",
          "[models][blocks]") {
  for (bool tie : {true, false}) {
    INFO("tie_weights " << tie);
    auto gpt = std::dynamic_pointer_cast<GPT>(make_model("gpt", {.dropout = 0.0,
                                                                 .vocab_size = 11,
                                                                 .context = 8,
                                                                 .n_layer = 3,
                                                                 .n_head = 2,
                                                                 .d_model = 8,
                                                                 .tie_weights = tie}));
    REQUIRE(gpt);
    check_model(*gpt, [&](const TensorList& in) { return TensorList{gpt_by_hand(*gpt, in[0])}; },
                {tokens(2, 7, 11)});
    const BlockList& b = gpt->blocks();
    REQUIRE(b.size() == 5);
    CHECK(b[2].name == "transformer.h.1");
    CHECK(names_of(b.named_parameters(2, 3))[0] == "transformer.h.1.ln_1.weight");
    // The head's stage owns ln_f and lm_head; tied, lm_head.weight is the
    // embedding's tensor, listed by both stages.
    CHECK(names_of(b.state(4, 5)) == std::vector<std::string>{"transformer.ln_f.weight",
                                                              "transformer.ln_f.bias",
                                                              "lm_head.weight"});
    if (tie) {
      REQUIRE(b.tied().size() == 1);
      CHECK(b.tied()[0].name == "lm_head.weight");
      CHECK(b.tied()[0].tied_to == "transformer.wte.weight");
      CHECK(b.tied()[0].block == 4);
      CHECK(b.tied()[0].tied_block == 0);
    } else {
      CHECK(b.tied().empty());
    }
  }
}

TEST_CASE("blocks: the LSTM LM is a block per layer, each carrying its layer's state",
          "[models][blocks]") {
  for (bool tie : {false, true}) {
    INFO("tie_weights " << tie);
    auto lm = std::dynamic_pointer_cast<LSTMLM>(make_model("lstm_lm", {.dropout = 0.0,
                                                                       .vocab_size = 9,
                                                                       .n_layer = 2,
                                                                       .d_model = 6,
                                                                       .hidden = 6,
                                                                       .tie_weights = tie}));
    REQUIRE(lm);
    Generator gen(3);
    const TensorList inputs = {tokens(2, 5, 9), rand_tensor({2, 6}, gen), rand_tensor({2, 6}, gen),
                               rand_tensor({2, 6}, gen), rand_tensor({2, 6}, gen)};
    check_model(
        *lm, [&](const TensorList& in) { return lstm_by_hand(*lm, in); }, inputs);
    const BlockList& b = lm->blocks();
    REQUIRE(b.size() == 2);
    CHECK(b[0].name == "rnn.0");
    CHECK(b[1].name == "rnn.1");
    CHECK(b.boundary(0) == std::vector<std::string>{"tokens", "h0", "c0", "h1", "c1"});
    // Layer 1's state passes layer 0's stage untouched; layer 0's stays there.
    CHECK(b.boundary(1) == std::vector<std::string>{"h0", "c0", "h1", "c1", "x"});
    CHECK(b.boundary(2) == std::vector<std::string>{"logits", "h0", "c0", "h1", "c1"});
    // Each block owns only its layer's LSTM weights (and the embedding or decoder).
    std::vector<std::string> first, second;
    for (const NamedTensor& p : b.named_parameters(0, 1)) first.push_back(p.name);
    for (const NamedTensor& p : b.named_parameters(1, 2)) second.push_back(p.name);
    CHECK(first == std::vector<std::string>{"encoder.weight", "rnn.weight_ih_l0",
                                            "rnn.weight_hh_l0", "rnn.bias_ih_l0",
                                            "rnn.bias_hh_l0"});
    // Tied, the last block holds the embedding's tensor as decoder.weight.
    CHECK(second == std::vector<std::string>{"rnn.weight_ih_l1", "rnn.weight_hh_l1",
                                             "rnn.bias_ih_l1", "rnn.bias_hh_l1", "decoder.weight",
                                             "decoder.bias"});
    if (tie) {
      REQUIRE(b.tied().size() == 1);
      CHECK(b.tied()[0].name == "decoder.weight");
      CHECK(b.tied()[0].tied_to == "encoder.weight");
      CHECK(b.tied()[0].block == 1);
      CHECK(b.tied()[0].tied_block == 0);
    } else {
      CHECK(b.tied().empty());
    }
    // An undefined state means zeros, as before.
    LSTMLMOutput zero_state = lm->forward(inputs[0], RNNState{});
    Tensor z = zeros({2, 6});
    require_close(zero_state.logits, lstm_by_hand(*lm, {inputs[0], z, z, z, z})[0], 0.0, 0.0,
                  "zero state");
  }
}

TEST_CASE("blocks: a long skip connection is live across every boundary it spans",
          "[models][blocks]") {
  auto twice = [](const TensorList& in) { return TensorList{in[0] * 2.0}; };
  BlockList blocks(
      {"x"}, {"y"},
      {{.name = "a",
        .outputs = {"x", "skip"},
        .fn =
            [](const TensorList& in) {
              return TensorList{in[0] + 1.0, in[0]};
            }},
       {.name = "b", .fn = twice},
       {.name = "c", .fn = twice},
       {.name = "d", .inputs = {"x", "skip"}, .outputs = {"y"}, .fn = [](const TensorList& in) {
          return TensorList{in[0] - in[1]};
        }}});
  CHECK(blocks.boundary(1) == std::vector<std::string>{"x", "skip"});
  CHECK(blocks.boundary(3) == std::vector<std::string>{"x", "skip"});
  CHECK(blocks.boundary(4) == std::vector<std::string>{"y"});
  Tensor x = from_vector(std::vector<float>{1, 2}, {2});
  // ((x + 1) * 4) - x
  require_close(blocks.run({x})[0], from_vector(std::vector<float>{7, 10}, {2}), 0, 0, "run");
  TensorList mid = blocks.run(0, 2, {x});
  require_close(blocks.run(2, 4, mid)[0], from_vector(std::vector<float>{7, 10}, {2}), 0, 0,
                "sliced");

  std::string unread = check_failure_of([] {
    BlockList(
        {"x"}, {"y"},
        {{.name = "a", .inputs = {"x", "h"}, .outputs = {"y"}, .fn = [](const TensorList& in) {
            return in;
          }}});
  });
  CHECK(unread.find("'h' is read before any block writes it") != std::string::npos);
}

TEST_CASE("blocks: wrappers run around every block in order, and recompute is one of them",
          "[models][blocks]") {
  auto plus_one = [](const TensorList& in) { return TensorList{in[0] + 1.0}; };
  BlockList blocks({"x"}, {"x"}, {{.name = "a", .fn = plus_one}, {.name = "b", .fn = plus_one}});
  std::vector<std::string> trace;
  // outer doubles what the inner chain returns; inner adds 10 to the inputs.
  blocks.add_wrapper(
      {.name = "outer", .run = [&](const BlockSpec& b, const TensorList& in, const BlockFn& next) {
         trace.push_back("outer " + b.name);
         return TensorList{next(in)[0] * 2.0};
       }});
  blocks.add_wrapper(
      {.name = "inner", .run = [&](const BlockSpec& b, const TensorList& in, const BlockFn& next) {
         trace.push_back("inner " + b.name);
         return next({in[0] + 10.0});
       }});
  Tensor x = from_vector(std::vector<float>{1}, {1});
  // a: (1 + 10 + 1) * 2 = 24; b: (24 + 10 + 1) * 2 = 70.
  require_close(blocks.run({x})[0], from_vector(std::vector<float>{70}, {1}), 0, 0, "wrapped");
  CHECK(trace == std::vector<std::string>{"outer a", "inner a", "outer b", "inner b"});
  // Replacing keeps the place; removing leaves the block's own function.
  blocks.add_wrapper(
      {.name = "outer", .run = [](const BlockSpec&, const TensorList& in, const BlockFn& next) {
         return next(in);
       }});
  CHECK(blocks.wrappers().size() == 2);
  CHECK(blocks.wrappers()[0].name == "outer");
  require_close(blocks.run({x})[0], from_vector(std::vector<float>{23}, {1}), 0, 0, "replaced");
  blocks.remove_wrapper("inner");
  blocks.remove_wrapper("outer");
  require_close(blocks.run({x})[0], from_vector(std::vector<float>{3}, {1}), 0, 0, "plain");

  // Recompute as a wrapper: it runs the chain inside it again in backward.
  Tensor w = from_vector(std::vector<float>{3}, {1}).requires_grad_();
  int runs = 0;
  BlockList scaled({"x"}, {"x"}, {{.name = "s", .fn = [&](const TensorList& in) {
                                     ++runs;
                                     return TensorList{in[0] * w};
                                   }}});
  scaled.set_recompute(true);
  CHECK(scaled.recompute());
  scaled.add_wrapper(
      {.name = "count", .run = [&](const BlockSpec&, const TensorList& in, const BlockFn& next) {
         trace.push_back("count");
         return next(in);
       }});
  trace.clear();
  Tensor y = scaled.run({from_vector(std::vector<float>{2}, {1}).requires_grad_()})[0];
  sum(y).backward();
  CHECK(runs == 2);  // forward, and again in backward
  CHECK(trace == std::vector<std::string>{"count", "count"});
  CHECK(w.grad().item<float>() == 2.0f);
  scaled.set_recompute(false);
  CHECK(!scaled.recompute());
}

// Deferred initialisation (core/tensor.h): a pipeline stage builds the model
// with no memory for its weights and materialises only its own blocks.
TEST_CASE("deferred init: every model built deferred is, block by block, the model built at once",
          "[models][blocks][deferred]") {
  const std::vector<std::pair<std::string, ModelOptions>> models = {
      {"resnet18_small", {.num_classes = 10, .image_size = 16, .width = 8}},
      {"resnet50_small", {.num_classes = 10, .image_size = 16, .width = 8}},
      {"small_cnn", {.num_classes = 10, .in_channels = 1, .image_size = 28}},
      {"mlp", {.num_classes = 10, .in_channels = 1, .image_size = 28}},
      {"gpt", {.vocab_size = 11, .context = 8, .n_layer = 3, .n_head = 2, .d_model = 8}},
      {"gpt",
       {.vocab_size = 11,
        .context = 8,
        .n_layer = 3,
        .n_head = 2,
        .d_model = 8,
        .tie_weights = false}},
      {"lstm_lm", {.vocab_size = 11, .n_layer = 2, .d_model = 8, .hidden = 8}},
      {"lstm_lm",
       {.vocab_size = 11, .n_layer = 2, .d_model = 8, .hidden = 8, .tie_weights = false}}};
  for (const auto& [name, options] : models) {
    INFO(name << (options.tie_weights ? "" : " untied"));
    std::shared_ptr<Model> at_once = make_model(name, options);
    Allocator& a = allocator(Device{});
    const int64_t before = a.stats().current_bytes;
    std::shared_ptr<Model> deferred;
    {
      DeferredInit scope;
      deferred = make_model(name, options);
    }
    CHECK(a.stats().current_bytes == before);  // no weight has memory yet
    const std::vector<NamedTensor> want = at_once->state(), got = deferred->state();
    REQUIRE(names_of(got) == names_of(want));
    for (const NamedTensor& t : got)
      if (t.tensor.numel() > 0) CHECK(is_deferred(t.tensor));
    // The last block alone first, as the last stage would: its tensors are
    // made, the others stay without memory.
    const BlockList& blocks = deferred->blocks();
    const size_t n = blocks.size();
    std::set<const TensorImpl*> last;
    for (const NamedTensor& t : blocks.state(n - 1, n)) {
      materialize(t.tensor);
      last.insert(t.tensor.impl());
    }
    for (const NamedTensor& t : got)
      if (t.tensor.numel() > 0) CHECK(is_deferred(t.tensor) == !last.count(t.tensor.impl()));
    // Block by block backwards, then every tensor against the model built at once.
    for (size_t b = n; b-- > 0;)
      for (const NamedTensor& t : blocks.state(b, b + 1)) materialize(t.tensor);
    for (size_t k = 0; k < got.size(); ++k) {
      REQUIRE_FALSE(is_deferred(got[k].tensor));
      require_close(got[k].tensor, want[k].tensor, 0.0, 0.0, got[k].name);
    }
  }
}

TEST_CASE("deferred init: shards, device moves, profiles and unread tensors",
          "[models][blocks][deferred]") {
  Generator gen(3);
  Tensor w;
  {
    DeferredInit scope;
    w = empty({4, 6});
    normal_(w, 0.0, 1.0, gen);
  }
  Generator same(3);
  const Tensor expected = normal({4, 6}, 0.0, 1.0, same);
  CHECK(gen.offset() == same.offset());  // the generator moved on as if it had drawn
  // A tensor-parallel shard of a deferred weight is deferred, and its
  // value is the shard of the weight's.
  const ParameterSplit split{.kind = ParameterSplit::Kind::sharded, .dim = 1, .rank = 1, .size = 2};
  Tensor shard = shard_of(w, split);
  CHECK(is_deferred(shard));
  CHECK(shard.shape() == Shape{4, 3});
  require_close(value_of(shard), shard_of(expected, split), 0.0, 0.0, "shard");
  CHECK(is_deferred(w));  // value_of made a copy, not w
  // Made, returned to its record, made again: the same value.
  materialize(w);
  require_close(w, expected, 0.0, 0.0, "materialised");
  w.fill_(7.0);
  unmaterialize(w);
  CHECK(is_deferred(w));
  materialize(w);
  require_close(w, expected, 0.0, 0.0, "made again");
  // Reading a deferred tensor is a CHECK failure that says what it is.
  Tensor unread;
  {
    DeferredInit scope;
    unread = ones({3});
  }
  CHECK_THAT(
      check_failure_of([&] { (void)unread.clone(); }),
      Catch::Contains("reading a deferred tensor [3]") && Catch::Contains("before materialize()"));
  // Outside the scope, tensors are made as ever.
  CHECK_FALSE(is_deferred(ones({3})));
}
