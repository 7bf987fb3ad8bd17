// kvlm's chat template interpreter against Python's jinja2, byte for byte.
//
// tests/data/chat-templates/*.jinja are real model chat templates (provenance in the README
// there); expected/<template>.json holds, for each case, the context and what jinja2 rendered
// (or the error it raised) under transformers' environment, made by
// tools/make_template_goldens.py and committed, so this test needs no Python. Every case must
// render to exactly the same bytes; a case where jinja2 raised must throw kvlm::Error, with
// the same message when the template raised it itself (raise_exception).
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/chat_template.h"

using namespace kvlm;
namespace fs = std::filesystem;

namespace {

const fs::path kDir = fs::path(KVLM_TEST_DATA) / "data" / "chat-templates";

std::string read(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::vector<std::string> template_names() {
  std::vector<std::string> names;
  if (!fs::is_directory(kDir)) return names;
  for (const auto& e : fs::directory_iterator(kDir))
    if (e.path().extension() == ".jinja") names.push_back(e.path().stem().string());
  std::sort(names.begin(), names.end());
  return names;
}

// "2024-07-26T10:30:00" -> a normalized std::tm (weekday and day of year filled in).
std::tm parse_now(const std::string& iso) {
  std::tm tm{};
  std::istringstream in(iso);
  in >> std::get_time(&tm, "%Y-%m-%dT%H:%M:%S");
  EXPECT_FALSE(in.fail()) << "bad time " << iso;
  const std::time_t t = timegm(&tm);
  gmtime_r(&t, &tm);
  return tm;
}

// Where two renderings first differ, with a little context, for a readable failure.
std::string first_difference(const std::string& want, const std::string& got) {
  size_t i = 0;
  while (i < want.size() && i < got.size() && want[i] == got[i]) ++i;
  auto around = [&](const std::string& s) {
    const size_t b = i < 40 ? 0 : i - 40;
    return nlohmann::json(s.substr(b, 80)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  };
  return "first difference at byte " + std::to_string(i) + " (expected " + std::to_string(want.size()) + " bytes, got " +
         std::to_string(got.size()) + ")\n  expected: ..." + around(want) + "\n  got:      ..." + around(got);
}

TEST(ChatTemplateGoldens, EveryTemplateHasExpectedRenderings) {
  const auto names = template_names();
  ASSERT_GE(names.size(), 10u) << "chat templates missing from " << kDir;
  std::set<std::string> expected;
  for (const auto& e : fs::directory_iterator(kDir / "expected"))
    if (e.path().extension() == ".json") expected.insert(e.path().stem().string());
  for (const auto& n : names) EXPECT_TRUE(expected.count(n)) << "no expected/" << n << ".json";
  for (const auto& n : expected)
    EXPECT_TRUE(std::find(names.begin(), names.end(), n) != names.end()) << "expected/" << n << ".json has no template";
}

class ChatTemplateGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(ChatTemplateGolden, MatchesJinja2) {
  const std::string name = GetParam();
  const std::string file = name + ".jinja";
  const ChatTemplate tpl = ChatTemplate::parse(read(kDir / file), file);
  const auto doc = nlohmann::ordered_json::parse(read(kDir / "expected" / (name + ".json")));
  ASSERT_EQ(doc.at("template").get<std::string>(), file);
  ChatTemplateRenderOptions options;
  options.now = parse_now(doc.at("now").get<std::string>());
  const auto& cases = doc.at("cases");
  ASSERT_GE(cases.size(), 15u);
  int mismatches = 0;
  for (const auto& c : cases) {
    const std::string case_name = c.at("name").get<std::string>();
    SCOPED_TRACE(file + " / " + case_name);
    if (c.contains("expected")) {
      std::string got;
      try {
        got = tpl.render(c.at("context"), options);
      } catch (const Error& e) {
        ++mismatches;
        ADD_FAILURE() << "threw: " << e.what();
        continue;
      }
      const std::string want = c.at("expected").get<std::string>();
      if (got != want) {
        ++mismatches;
        ADD_FAILURE() << first_difference(want, got);
      }
    } else {
      const std::string error = c.at("error").get<std::string>();
      try {
        const std::string got = tpl.render(c.at("context"), options);
        ++mismatches;
        ADD_FAILURE() << "jinja2 raised " << c.at("error_type").get<std::string>() << ": " << error
                      << "\nkvlm rendered " << got.size() << " bytes";
      } catch (const Error& e) {
        if (c.at("error_type") == "TemplateError") EXPECT_EQ(std::string(e.what()), file + ": " + error);
      }
    }
  }
  EXPECT_EQ(mismatches, 0) << mismatches << " of " << cases.size() << " cases differ from jinja2";
}

INSTANTIATE_TEST_SUITE_P(Templates, ChatTemplateGolden, ::testing::ValuesIn(template_names()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string n = info.param;
                           for (char& ch : n)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });

// The nlohmann::json overload (sorted keys) renders the same as ordered_json when the
// template does not print key order.
TEST(ChatTemplateGoldens, PlainJsonContext) {
  const ChatTemplate tpl = ChatTemplate::parse(read(kDir / "Qwen-Qwen2.5-7B-Instruct.jinja"));
  const auto ctx = nlohmann::json::parse(R"({"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": true})");
  EXPECT_EQ(tpl.render(ctx),
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

}  // namespace
