// Models: torchvision's ResNet names, shapes and parameter counts at every
// depth, the small-image variant, the Fashion-MNIST models, eval-mode fusion,
// and a tiny ResNet overfitting a fixed batch.
#include "tests/testing.h"

#include <map>

#include "models/registry.h"
#include "models/resnet.h"
#include "models/small.h"

using namespace trainer;
using namespace trainer::testing;

namespace {

std::map<std::string, Shape> shapes(const std::vector<NamedTensor>& ts) {
  std::map<std::string, Shape> out;
  for (const NamedTensor& t : ts) out[t.name] = t.tensor.shape();
  return out;
}

}  // namespace

namespace {

struct Expect {
  int depth;
  int64_t params;
  size_t param_tensors, buffers;
};

// Counts from torchvision.models.resnetN(): sum of numel, len(named_parameters()),
// len(named_buffers()); and the shapes of a few names every depth has.
std::shared_ptr<Module> check_resnet(const Expect& e) {
  INFO("resnet" << e.depth);
  std::shared_ptr<Module> net = make_model("resnet" + std::to_string(e.depth));
  REQUIRE(net->num_parameters() == e.params);
  REQUIRE(net->named_parameters().size() == e.param_tensors);
  REQUIRE(net->named_buffers().size() == e.buffers);
  auto s = shapes(net->state());
  REQUIRE(s.at("conv1.weight") == Shape{64, 3, 7, 7});
  REQUIRE(s.at("bn1.num_batches_tracked") == Shape{});
  int64_t feat = e.depth < 50 ? 512 : 2048;
  REQUIRE(s.at("fc.weight") == Shape{1000, feat});
  REQUIRE(s.at("layer2.0.downsample.0.weight") == Shape{feat / 4, feat / 8, 1, 1});
  REQUIRE(s.at("layer4.1.bn1.running_var") == Shape{512});
  REQUIRE(s.count("layer1.0.downsample.0.weight") == (e.depth >= 50 ? 1u : 0u));
  return net;
}

}  // namespace

TEST_CASE("resnet: torchvision parameter counts, names and shapes (18, 50)", "[models]") {
  std::shared_ptr<Module> r18 = check_resnet({18, 11689512, 62, 60});
  auto s50 = shapes(check_resnet({50, 25557032, 161, 159})->named_parameters());
  REQUIRE(s50.at("layer1.0.conv1.weight") == Shape{64, 64, 1, 1});
  REQUIRE(s50.at("layer1.0.conv3.weight") == Shape{256, 64, 1, 1});
  REQUIRE(s50.at("layer2.0.conv2.weight") == Shape{128, 128, 3, 3});
  REQUIRE(s50.at("layer3.5.bn3.weight") == Shape{1024});
  REQUIRE(s50.count("layer3.6.conv1.weight") == 0);
  std::vector<NamedTensor> p18 = r18->named_parameters();
  std::vector<std::string> first;
  for (size_t i = 0; i < 10; ++i) first.push_back(p18[i].name);
  REQUIRE(first == std::vector<std::string>{
                       "conv1.weight", "bn1.weight", "bn1.bias", "layer1.0.conv1.weight",
                       "layer1.0.bn1.weight", "layer1.0.bn1.bias", "layer1.0.conv2.weight",
                       "layer1.0.bn2.weight", "layer1.0.bn2.bias", "layer1.1.conv1.weight"});
  REQUIRE(p18.back().name == "fc.bias");
  REQUIRE_THROWS_AS(make_model("resnet19"), Error);
}

TEST_CASE("resnet: torchvision parameter counts, names and shapes (34, 101, 152)",
          "[models][slow]") {
  check_resnet({34, 21797672, 110, 108});
  check_resnet({101, 44549160, 314, 312});
  check_resnet({152, 60192808, 467, 465});
}

TEST_CASE("resnet: forward shapes, small-image variant and zero-init residual", "[models]") {
  Generator gen(1);
  auto net = resnet({.depth = 18, .num_classes = 7, .width = 8});
  Tensor y = (*net)(rand_tensor({2, 3, 64, 64}, gen));
  REQUIRE(y.shape() == Shape{2, 7});
  auto small = resnet({.depth = 50,
                       .num_classes = 10,
                       .in_channels = 1,
                       .small_input = true,
                       .zero_init_residual = true,
                       .width = 4});
  REQUIRE(shapes(small->named_parameters()).at("conv1.weight") == Shape{4, 1, 3, 3});
  int zeroed = 0;
  for (const NamedTensor& p : small->named_parameters()) {
    bool last_bn = p.name.size() > 11 && p.name.substr(p.name.size() - 11) == ".bn3.weight";
    if (last_bn) REQUIRE(max(abs(p.tensor)).item<double>() == 0.0);
    zeroed += last_bn;
  }
  REQUIRE(zeroed == 16);  // one per bottleneck block
  REQUIRE((*small)(rand_tensor({2, 1, 28, 28}, gen)).shape() == Shape{2, 10});
}

TEST_CASE("small models: Fashion-MNIST CNN and MLP", "[models]") {
  Generator gen(2);
  auto cnn = make_model("small_cnn", {.num_classes = 10, .in_channels = 1, .image_size = 28});
  REQUIRE(cnn->num_parameters() == 421834);
  auto mlp = make_model("mlp", {.num_classes = 10, .in_channels = 1, .image_size = 28});
  REQUIRE(mlp->num_parameters() == 235146);
  Tensor x = rand_tensor({3, 1, 28, 28}, gen);
  REQUIRE((*cnn)(x).shape() == Shape{3, 10});
  REQUIRE((*mlp)(x).shape() == Shape{3, 10});
  cnn->eval();
  REQUIRE((*cnn)(x).shape() == Shape{3, 10});
}

TEST_CASE("resnet: eval-mode fused conv + bn + relu equals the unfused blocks", "[models]") {
  Generator gen(3);
  for (int depth : {18, 50}) {
    INFO("resnet" << depth);
    auto net = resnet({.depth = depth, .num_classes = 5, .width = 8, .seed = 3});
    // A few training steps give the running statistics non-trivial values.
    for (int i = 0; i < 3; ++i) (*net)(rand_tensor({4, 3, 32, 32}, gen) * 2.0 + 0.3);
    net->eval();
    Tensor x = rand_tensor({2, 3, 32, 32}, gen);
    Tensor fused = (*net)(x);
    // The same network with every conv -> bn pair run unfused: convs and batch
    // norms called one by one through a block-by-block re-implementation.
    auto unfused_block = [](Module& m, const Tensor& in) -> Tensor {
      auto cb = [](Conv2d& c, BatchNorm2d& b, const Tensor& t, bool r) {
        Tensor y = b(c(t));
        return r ? relu_channels_last(y) : y;
      };
      Tensor out, identity = in;
      if (auto* b = dynamic_cast<BasicBlock*>(&m)) {
        out = cb(*b->conv2, *b->bn2, cb(*b->conv1, *b->bn1, in, true), false);
        if (b->downsample) identity = (*b->downsample)(in);
      } else {
        auto* k = dynamic_cast<Bottleneck*>(&m);
        out = cb(*k->conv1, *k->bn1, in, true);
        out = cb(*k->conv3, *k->bn3, cb(*k->conv2, *k->bn2, out, true), false);
        if (k->downsample) identity = (*k->downsample)(in);
      }
      return relu_channels_last(add_channels_last(out, identity));
    };
    std::map<std::string, Module*> mods;
    for (const auto& [name, child] : net->children()) mods[name] = child.get();
    auto* conv1 = dynamic_cast<Conv2d*>(mods.at("conv1"));
    auto* bn1 = dynamic_cast<BatchNorm2d*>(mods.at("bn1"));
    Tensor y = max_pool2d(relu_channels_last((*bn1)((*conv1)(x))),
                          {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}});
    for (const char* layer : {"layer1", "layer2", "layer3", "layer4"}) {
      auto* seq = dynamic_cast<Sequential*>(mods.at(layer));
      for (size_t i = 0; i < seq->size(); ++i) y = unfused_block((*seq)[i], y);
    }
    Tensor unfused = (*mods.at("fc"))(adaptive_avg_pool2d(y, 1, 1).flatten(1));
    require_close(fused, unfused, 1e-4, 1e-4, "fused vs unfused logits");
  }
}

TEST_CASE("resnet: a tiny small-image ResNet overfits a fixed batch with plain SGD", "[models]") {
  Generator gen(4);
  auto net = resnet({.depth = 18,
                     .num_classes = 4,
                     .in_channels = 1,
                     .small_input = true,
                     .width = 4,
                     .seed = 4});
  Tensor x = rand_tensor({8, 1, 12, 12}, gen);
  Tensor target = from_vector<int64_t>({0, 1, 2, 3, 3, 2, 1, 0});
  TensorList params = net->parameters();
  std::vector<Tensor> velocity;
  for (const Tensor& p : params) velocity.push_back(zeros_like(p));
  double first = 0, last = 0;
  for (int step = 0; step < 60; ++step) {
    Tensor loss = cross_entropy((*net)(x), target);
    if (step == 0) first = loss.item<double>();
    last = loss.item<double>();
    net->zero_grad();
    loss.backward();
    autograd::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {  // SGD, momentum 0.9, lr 0.05
      mul_(velocity[i], 0.9);
      add_(velocity[i], params[i].grad());
      add_(params[i].detach(), velocity[i], -0.05);
    }
  }
  INFO("loss " << first << " -> " << last);
  REQUIRE(first > 1.0);
  REQUIRE(last < 0.02);
}

TEST_CASE("registry: each model's traits, asked by the trainer before building it", "[models]") {
  for (const std::string& name : model_names()) {
    INFO(name);
    const ModelTraits t = model_traits(name);
    CHECK(t.language_model == is_language_model(name));
    const bool transformer = name == "gpt" || name == "llama";
    CHECK(t.language_model == (transformer || name == "lstm_lm"));
    CHECK(t.recurrent == (name == "lstm_lm"));
    CHECK(t.sequence_parallel == transformer);
    CHECK(t.bounded_context == transformer);
  }
  CHECK(!model_traits("no_such_model").language_model);
}
