// kvlm eval's pure parts: answer extraction and task-file parsing; calibration's scales.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "offline/calibrate.h"
#include "offline/eval.h"

using namespace kvlm;
namespace fs = std::filesystem;

TEST(Eval, ExtractsTheFirstGroupOrTheMatchOrTheTrimmedText) {
  EXPECT_EQ(extract_answer("so the answer is 42.", R"(answer is (\d+))"), "42");
  EXPECT_EQ(extract_answer("x 17 y", R"(\d+)"), "17");
  EXPECT_EQ(extract_answer("  hello \n", ""), "hello");
  EXPECT_EQ(extract_answer("no digits", R"((\d+))"), std::nullopt);
}

TEST(Eval, TaskFilesAreParsedWithLineNumbersInErrors) {
  const fs::path p = fs::temp_directory_path() / "kvlm_test_task.jsonl";
  {
    std::ofstream f(p);
    f << R"j({"prompt": "2+2=", "answer": 4, "regex": "(\\d+)", "stop": ["\n"]})j" << "\n\n"
      << R"({"prompt": "say hi", "answer": "hi", "stop": "."})" << "\n";
  }
  const auto items = load_task_file(p);
  ASSERT_EQ(items.size(), 2u);
  EXPECT_EQ(items[0].answer, "4");
  EXPECT_EQ(items[0].stop, std::vector<std::string>{"\n"});
  EXPECT_EQ(items[1].stop, std::vector<std::string>{"."});
  {
    std::ofstream f(p);
    f << R"({"prompt": "a", "answer": "b"})" << "\n" << R"({"prompt": "a"})" << "\n";
  }
  try {
    load_task_file(p);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(":2: \"answer\" is missing"), std::string::npos) << e.what();
  }
  fs::remove(p);
}

TEST(Calibrate, ScalesAreAbsmaxOverE4M3Max) {
  ModelOptions o;
  o.model_dir = fs::path(KVLM_TEST_DATA) / "golden" / "models" / "qwen3-mixed";
  auto e = LoadedModel::load(o);
  const std::vector<std::vector<TokenId>> samples{{1, 5, 9, 33, 2, 7}, {4, 4, 4}};
  const auto per_layer = calibrate_kv(*e, samples, false);
  const auto per_head = calibrate_kv(*e, samples, true);
  ASSERT_EQ(per_layer.layers.size(), 4u);
  EXPECT_EQ(per_layer.num_tokens, 9);
  for (size_t i = 0; i < per_layer.layers.size(); ++i) {
    const auto& l = per_layer.layers[i];
    ASSERT_EQ(l.k_scale.size(), 1u);
    const float kmax = *std::max_element(l.k_absmax.begin(), l.k_absmax.end());
    EXPECT_GT(kmax, 0.0f);
    EXPECT_FLOAT_EQ(l.k_scale[0], kmax / 448.0f);
    const auto& h = per_head.layers[i];
    ASSERT_EQ(h.v_scale.size(), h.v_absmax.size());
    for (size_t k = 0; k < h.v_scale.size(); ++k) EXPECT_FLOAT_EQ(h.v_scale[k], std::max(h.v_absmax[k] / 448.0f, 1e-8f));
  }
  const std::vector<std::vector<TokenId>> none;
  EXPECT_THROW(calibrate_kv(*e, none, false), Error);
}
