// matmul: finite-difference gradients, a closed form, and the oneDNN fast
// path against the reference kernel on odd shapes, strided (transposed,
// sliced) operands and broadcast batch dims.
#include "tests/testing.h"

using namespace trainer;
using namespace trainer::testing;

namespace {

Tensor mm(const TensorList& in) { return matmul(in[0], in[1]); }

}  // namespace

TEST_CASE("matmul: closed form", "[linalg]") {
  Tensor a = from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor b = from_vector<float>({7, 8, 9, 10, 11, 12}, {3, 2});
  REQUIRE(matmul(a, b).to_vector<float>() == std::vector<float>{58, 64, 139, 154});
  // a^T a through a transposed view: [[17, 22, 27], [22, 29, 36], [27, 36, 45]].
  REQUIRE(matmul(a.t(), a).to_vector<float>() ==
          std::vector<float>{17, 22, 27, 22, 29, 36, 27, 36, 45});
  Tensor v = from_vector<float>({1, -1, 2});
  REQUIRE(matmul(a, v).shape() == Shape{2});
  REQUIRE(matmul(a, v).to_vector<float>() == std::vector<float>{5, 11});
  REQUIRE(matmul(v, v).dim() == 0);
  REQUIRE(matmul(v, v).item<float>() == 6.0f);
  // K == 0: a sum over nothing.
  REQUIRE(matmul(zeros({3, 0}), zeros({0, 2})).to_vector<float>() == std::vector<float>(6, 0.0f));
}

TEST_CASE("matmul: gradcheck", "[linalg]") {
  Generator gen(1, 11);
  SECTION("2-d") { gradcheck(mm, {rand_f64({3, 4}, gen), rand_f64({4, 5}, gen)}); }
  SECTION("batched") { gradcheck(mm, {rand_f64({2, 3, 4}, gen), rand_f64({2, 4, 2}, gen)}); }
  SECTION("broadcast batch [2,1,3,4] @ [5,4,2]") {
    gradcheck(mm, {rand_f64({2, 1, 3, 4}, gen), rand_f64({5, 4, 2}, gen)});
  }
  SECTION("batched @ matrix") { gradcheck(mm, {rand_f64({3, 2, 4}, gen), rand_f64({4, 3}, gen)}); }
  SECTION("vec @ mat") { gradcheck(mm, {rand_f64({4}, gen), rand_f64({4, 3}, gen)}); }
  SECTION("mat @ vec") { gradcheck(mm, {rand_f64({3, 4}, gen), rand_f64({4}, gen)}); }
  SECTION("batched @ vec") { gradcheck(mm, {rand_f64({2, 3, 4}, gen), rand_f64({4}, gen)}); }
  SECTION("dot") { gradcheck(mm, {rand_f64({5}, gen), rand_f64({5}, gen)}); }
  SECTION("transposed operands") {
    gradcheck([](const TensorList& in) { return matmul(in[0].t(), in[1].transpose(0, 1)); },
              {rand_f64({4, 3}, gen), rand_f64({2, 4}, gen)});
  }
}

TEST_CASE("matmul: oneDNN matches the reference on odd shapes", "[linalg]") {
  Generator gen(2, 11);
  const int64_t sizes[][3] = {{1, 1, 1},    {1, 7, 33},   {33, 1, 7},  {7, 33, 1},
                              {33, 129, 7}, {129, 7, 33}, {7, 33, 129}};
  for (const auto& s : sizes) {
    int64_t M = s[0], K = s[1], N = s[2];
    INFO("M " << M << " K " << K << " N " << N);
    Tensor a = rand_tensor({M, K}, gen), b = rand_tensor({K, N}, gen);
    // The longest sum: K forward, M and N for the two gradients; terms of
    // size up to 1 (uniform [-1, 1] operands, cotangents up to 1.5).
    const int64_t n = std::max({M, K, N});
    const Reduction r{.length = n, .scale = 1.5 * std::sqrt(double(n))};
    check_fast_vs_reference(mm, {a, b}, r);
    // Transposed views (column-major for oneDNN) and sliced ones (no unit stride: copied).
    Tensor at = rand_tensor({K, M}, gen).t(), bt = rand_tensor({N, K}, gen).t();
    check_fast_vs_reference(mm, {at, bt}, r);
    check_fast_vs_reference(mm, {non_contiguous(a), bt}, r);
    check_fast_vs_reference(mm, {at, non_contiguous(b)}, r);
  }
}

TEST_CASE("matmul: oneDNN batch layouts match the reference", "[linalg]") {
  Generator gen(3, 11);
  auto check = [&](const Tensor& a, const Tensor& b) {
    INFO(a.shape_str() << " @ " << b.shape_str());
    // Sums of at most 33 terms, and the broadcast gradients sum over the batch too.
    check_fast_vs_reference(mm, {a, b}, {.length = 64, .scale = 12});
  };
  check(rand_tensor({2, 1, 7, 33}, gen), rand_tensor({5, 33, 9}, gen));   // both broadcast
  check(rand_tensor({3, 7, 5}, gen), rand_tensor({5, 4}, gen));           // b shared by the batch
  check(rand_tensor({7, 5}, gen), rand_tensor({3, 5, 4}, gen));           // a shared by the batch
  check(rand_tensor({2, 3, 7, 5}, gen), rand_tensor({2, 3, 5, 4}, gen));  // foldable batch dims
  // Batch dim not outermost in memory, and a transposed batched operand.
  check(rand_tensor({7, 3, 5}, gen).transpose(0, 1), rand_tensor({3, 4, 5}, gen).transpose(1, 2));
  // A batch dim of size 1 between broadcast ones, and a vector promoted to a matrix.
  check(rand_tensor({4, 1, 1, 3, 6}, gen), rand_tensor({1, 2, 1, 6, 3}, gen));
  check(rand_tensor({3, 7, 5}, gen), rand_tensor({5}, gen));
  check(rand_tensor({5}, gen), rand_tensor({3, 5, 7}, gen));
  // Expanded (stride-0) matrix dims cannot be described to oneDNN: copied first.
  check(rand_tensor({3, 5}, gen), rand_tensor({5, 1}, gen).expand({5, 4}));
  check(rand_tensor({1, 5}, gen).expand({3, 5}), rand_tensor({2, 5, 4}, gen));
}

TEST_CASE("matmul: bf16 on oneDNN matches the reference", "[linalg]") {
  Generator gen(4, 11);
  Tensor a = rand_tensor({2, 7, 33}, gen, -1, 1, DType::bf16);
  Tensor b = rand_tensor({33, 9}, gen, -1, 1, DType::bf16);
  // Both round one f32/double sum to bf16 (the gradients of a too: summed
  // over 9, of b over 14 rows); the backward reads the bf16-rounded inputs.
  check_fast_vs_reference(mm, {a, b}, {.length = 33, .scale = 8, .roundings = 2});
}
