// The size rules of the sources: no file of trainer/ over 450 lines, and no
// function of trainer/ or parallel/ over 80 lines (tables such as the recipe
// schema aside). A failure names each file, or each function with its
// file:line and length.
#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "tests/testing.h"

namespace fs = std::filesystem;

namespace {

const fs::path kSource = TRAINER_SOURCE_DIR;
constexpr size_t kMaxFileLines = 450;
constexpr size_t kMaxFunctionLines = 80;

// Functions that are tables, one entry a line: "file:function".
const std::set<std::string> kTables = {"trainer/recipe.cpp:schema"};

std::vector<std::string> split_lines(std::istream& in) {
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::vector<std::string> lines_of(const fs::path& file) {
  std::ifstream in(file);
  REQUIRE(in.good());
  return split_lines(in);
}

// The files of `dir` (relative to the source tree) with one of `extensions`,
// sorted so failures come in a stable order.
std::vector<fs::path> sources(const std::string& dir, const std::set<std::string>& extensions) {
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(kSource / dir))
    if (entry.is_regular_file() && extensions.count(entry.path().extension().string()))
      files.push_back(entry.path());
  std::sort(files.begin(), files.end());
  return files;
}

struct FunctionSpan {
  size_t line;       // of the signature's first line, from 1
  std::string name;  // "schema", "ImageBatches::ImageBatches"
  size_t length;     // lines from the signature's first to the closing brace
};

std::string without_comment(const std::string& line) {
  const size_t comment = line.find("//");
  std::string code = line.substr(0, comment);
  while (!code.empty() && std::isspace(static_cast<unsigned char>(code.back()))) code.pop_back();
  return code;
}

bool starts_with_word(const std::string& text, const std::string& word) {
  return text.rfind(word, 0) == 0 && (text.size() == word.size() ||
                                      !std::isalnum(static_cast<unsigned char>(text[word.size()])));
}

// The name before the signature's first parenthesis ("" when it is no
// function: a type, or a variable set from a braced table or a lambda).
std::string function_name(const std::string& signature) {
  for (const char* kind : {"struct", "class", "enum", "union"})
    if (starts_with_word(signature, kind)) return "";
  const size_t paren = signature.find('(');
  if (paren == std::string::npos) return "";
  const std::string head = signature.substr(0, paren);
  if (head.find('=') != std::string::npos && head.find("operator") == std::string::npos) return "";
  size_t begin = head.size();
  while (begin > 0 && (std::isalnum(static_cast<unsigned char>(head[begin - 1])) ||
                       std::string("_:~=!<>+-*/%&|^[]").find(head[begin - 1]) != std::string::npos))
    --begin;
  return head.substr(begin);
}

// The function definitions of a file formatted as this code base is
// (clang-format, namespaces not indented): a definition starts at a line in
// column 0 whose statement (possibly over several lines) ends in `{` and
// names a function, and ends at the next line that starts with `}`. Other
// braced statements at column 0 (types, tables) are skipped the same way;
// a namespace's lines are read on.
std::vector<FunctionSpan> function_definitions(const std::vector<std::string>& lines) {
  std::vector<FunctionSpan> found;
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string& first = lines[i];
    if (first.empty() || std::isspace(static_cast<unsigned char>(first[0])) ||
        std::string("}#/").find(first[0]) != std::string::npos)
      continue;
    const size_t start = i;
    std::string statement = without_comment(first);
    auto ended = [&] {
      return !statement.empty() && std::string("{;}").find(statement.back()) != std::string::npos;
    };
    while (!ended() && i + 1 < lines.size()) {
      statement += ' ';
      statement += without_comment(lines[++i]);
    }
    if (statement.empty() || statement.back() != '{' || starts_with_word(statement, "namespace") ||
        starts_with_word(statement, "extern"))
      continue;
    size_t end = i + 1;
    while (end < lines.size() && lines[end].rfind('}', 0) != 0) ++end;
    const std::string name = function_name(statement);
    if (!name.empty()) found.push_back({start + 1, name, end - start + 1});
    i = end;
  }
  return found;
}

std::vector<FunctionSpan> function_definitions(const std::string& text) {
  std::istringstream in(text);
  return function_definitions(split_lines(in));
}

// "file:line: function() is N lines" for every definition over the limit.
std::vector<std::string> long_functions(const std::string& file,
                                        const std::vector<std::string>& lines) {
  std::vector<std::string> found;
  for (const FunctionSpan& f : function_definitions(lines))
    if (f.length > kMaxFunctionLines && !kTables.count(file + ":" + f.name))
      found.push_back(file + ":" + std::to_string(f.line) + ": " + f.name + "() is " +
                      std::to_string(f.length) + " lines, over " +
                      std::to_string(kMaxFunctionLines) + ": extract helpers");
  return found;
}

// A function `name` whose body holds `body_lines` statements.
std::string function_text(const std::string& name, size_t body_lines) {
  std::string text = "int " + name + "(int a,\n        int b) {\n";
  for (size_t k = 0; k < body_lines; ++k) text += "  a += b;\n";
  return text + "  return a;\n}\n";
}

}  // namespace

TEST_CASE("sources: the function detector finds definitions as the code base formats them",
          "[docs]") {
  const std::string text = "// A file.\n#include <map>\n\nnamespace trainer {\n\nnamespace {\n\n" +
                           function_text("short_one", 10) +
                           "\nstruct Table {\n  int a;\n};\n\n"
                           "const std::map<int, int> kTable = {\n  {1, 2},\n};\n\n"
                           "int declared(int a);\n"
                           "int one_line(int a) { return a; }\n\n"
                           "}  // namespace\n\n" +
                           function_text("Big::too_long", 80) +
                           "\ntemplate <class T>\nT templated(T x) {\n  return x;\n}\n\n"
                           "}  // namespace trainer\n";
  const std::vector<FunctionSpan> found = function_definitions(text);
  REQUIRE(found.size() == 3);
  CHECK(found[0].name == "short_one");
  CHECK(found[0].line == 8);
  CHECK(found[0].length == 14);
  CHECK(found[1].name == "Big::too_long");
  CHECK(found[1].length == 84);
  CHECK(found[2].name == "templated");
  CHECK(found[2].length == 4);

  std::istringstream in(text);
  const std::vector<std::string> reported = long_functions("trainer/x.cpp", split_lines(in));
  REQUIRE(reported.size() == 1);
  CHECK(reported[0] == "trainer/x.cpp:" + std::to_string(found[1].line) +
                           ": Big::too_long() is 84 lines, over 80: extract helpers");
  std::istringstream table(function_text("schema", 90));
  CHECK(long_functions("trainer/recipe.cpp", split_lines(table)).empty());
}

TEST_CASE("sources: no file of trainer/ is over 450 lines", "[docs]") {
  std::vector<std::string> long_files;
  for (const fs::path& file : sources("trainer", {".cpp", ".h"})) {
    const size_t n = lines_of(file).size();
    if (n > kMaxFileLines)
      long_files.push_back(fs::relative(file, kSource).string() + " is " + std::to_string(n) +
                           " lines, over " + std::to_string(kMaxFileLines) +
                           ": move a part into a file of its own");
  }
  for (const std::string& f : long_files) UNSCOPED_INFO(f);
  CHECK(long_files.empty());
}

TEST_CASE("sources: no function of trainer/ or parallel/ is over 80 lines, tables aside",
          "[docs]") {
  std::vector<std::string> found;
  for (const std::string dir : {"trainer", "parallel"})
    for (const fs::path& file : sources(dir, {".cpp"})) {
      const auto more = long_functions(fs::relative(file, kSource).string(), lines_of(file));
      found.insert(found.end(), more.begin(), more.end());
    }
  for (const std::string& f : found) UNSCOPED_INFO(f);
  CHECK(found.empty());
}

TEST_CASE("sources: code comments point into the repository, not to documents outside it",
          "[docs]") {
  // The design notes of the team live outside the repository; the code's
  // own account is docs/architecture.md, which comments cite instead.
  std::vector<std::string> found;
  for (const std::string dir :
       {".", "core", "core/cpu", "core/cuda", "core/ref", "comm", "data", "layers", "models",
        "optim", "parallel", "trainer", "bench", "fuzz", "scripts", "tests"})
    for (const fs::path& file : sources(dir, {".cpp", ".h", ".cu", ".cuh", ".sh", ".py", ".txt"})) {
      const std::vector<std::string> lines = lines_of(file);
      // The names spelled in two parts, so that this test does not cite them.
      for (size_t i = 0; i < lines.size(); ++i)
        for (const std::string& outside :
             {std::string("DESIGN") + ".md", std::string("STYLE") + ".md"})
          if (lines[i].find(outside) != std::string::npos)
            found.push_back(fs::relative(file, kSource).string() + ":" + std::to_string(i + 1) +
                            " cites " + outside);
    }
  for (const std::string& f : found) UNSCOPED_INFO(f);
  CHECK(found.empty());
}
