// The user documentation (README.md, docs/) against the code: the recipe key
// table of docs/recipes.md is the schema of trainer/recipe.cpp, relative links
// resolve inside the repository, and no page speaks of how the project was
// developed (numbered sessions, issue numbers, goals met) instead of what it
// does. A failure names the file, the line or key, and what to change.
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "tests/testing.h"
#include "trainer/recipe.h"

using namespace trainer;
namespace fs = std::filesystem;

namespace {

const fs::path kSource = TRAINER_SOURCE_DIR;

std::vector<std::string> lines_of(const fs::path& file) {
  std::ifstream in(file);
  REQUIRE(in.good());
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// README.md and every page under docs/, sorted so failures come in a stable order.
std::vector<fs::path> documents() {
  std::vector<fs::path> files{kSource / "README.md"};
  if (fs::is_directory(kSource / "docs"))
    for (const auto& entry : fs::recursive_directory_iterator(kSource / "docs"))
      if (entry.is_regular_file() && entry.path().extension() == ".md")
        files.push_back(entry.path());
  std::sort(files.begin() + 1, files.end());
  return files;
}

// The first four cells of a key's row in docs/recipes.md, as the schema says
// they must read; the fifth cell (meaning) is written by hand.
std::string row_prefix(const RecipeKey& k) {
  const std::string def = k.default_value.empty() ? "(empty)" : "`" + k.default_value + "`";
  const std::string range = k.range.empty() ? "any text" : k.range;
  return "| `" + k.key + "` | " + k.type + " | " + def + " | " + range + " |";
}

// Words that describe how the project was developed rather than what it
// does. Chosen so product words pass: "trainer/session.cpp", "a training
// session", "rounds" of a benchmark, "issues" in general.
const std::vector<std::pair<std::regex, std::string>>& process_markers() {
  static const auto icase = std::regex::ECMAScript | std::regex::icase;
  static const std::vector<std::pair<std::regex, std::string>> markers = {
      {std::regex(R"(\bsessions?[ -]+[0-9])", icase), "a numbered session"},
      {std::regex(
           R"(\b(this|that|previous|next|last|earlier|later|same|each|every|one)\s+sessions?\b)",
           icase),
       "a development session"},
      {std::regex(R"(\bsession[- ]start\b)", icase), "a development session"},
      {std::regex(R"(\bissues?\s*#\s*[0-9])", icase), "an issue number"},
      {std::regex(R"(\bissues?\s+[0-9]+\b)", icase), "an issue number"},
      {std::regex(R"(\b(next|later|coming|future)\s+issues?\b)", icase), "issues as a plan"},
      {std::regex(R"(\bgoals?\s+(is\s+|was\s+)?(not\s+)?(yet\s+)?(met|reached)\b)", icase),
       "a development goal"},
      {std::regex(R"(\b[0-9.]+(%|x)\s+goal\b)", icase), "a development goal"},
      {std::regex(R"(\bavailable\s+to\s+us\b)", icase), "the developers' machines"},
      {std::regex(R"(\bneeds?\s+re-?measuring\b)", icase), "an unfinished measurement"},
      {std::regex(R"(\blab\s+notebook\b)", icase), "a lab notebook"},
      {std::regex(R"(\bwork\s+in\s+progress\b)", icase), "work in progress"},
      {std::regex(R"(\.\./shared/)", icase), "a path outside the repository"},
  };
  return markers;
}

// "file:line: <why>: <line>" for every line of `text` with a process marker.
std::vector<std::string> process_marker_hits(const std::string& name,
                                             const std::vector<std::string>& text) {
  std::vector<std::string> hits;
  for (size_t i = 0; i < text.size(); ++i)
    for (const auto& [pattern, why] : process_markers())
      if (std::regex_search(text[i], pattern))
        hits.push_back(name + ":" + std::to_string(i + 1) + ": " + why + ": " + text[i]);
  return hits;
}

}  // namespace

TEST_CASE("docs: recipes.md has one row per recipe key, as the schema declares it", "[docs]") {
  const fs::path file = kSource / "docs" / "recipes.md";
  const std::vector<std::string> lines = lines_of(file);
  // Rows of the key tables under "## Every key" (up to the next "## " heading):
  // "| `section.key` | type | default | range | meaning |".
  std::map<std::string, std::string> rows;
  const std::regex row(R"(^\| `([a-z0-9_.]+)` \|)");
  bool in_keys = false;
  for (const std::string& line : lines) {
    if (line.rfind("## ", 0) == 0) in_keys = line.rfind("## Every key", 0) == 0;
    std::smatch m;
    if (in_keys && std::regex_search(line, m, row)) rows[m[1]] = line;
  }
  REQUIRE_FALSE(rows.empty());  // the section exists and has rows
  std::vector<std::string> problems;
  std::set<std::string> keys;
  for (const RecipeKey& k : recipe_schema()) {
    keys.insert(k.key);
    const std::string want = row_prefix(k);
    auto it = rows.find(k.key);
    if (it == rows.end()) {
      problems.push_back("no row for key '" + k.key +
                         "'; add this row to its section's table:\n  " + want +
                         " <what it means> |");
    } else if (it->second.rfind(want, 0) != 0) {
      problems.push_back("the row of '" + k.key + "' is stale; its first cells must read:\n  " +
                         want + "\n  found:\n  " + it->second);
    } else if (it->second.size() < want.size() + 4) {
      problems.push_back("the row of '" + k.key + "' has no meaning: write one after\n  " + want);
    }
  }
  for (const auto& [key, line] : rows)
    if (!keys.count(key))
      problems.push_back("a row for '" + key +
                         "', which trainer/recipe.cpp does not declare: remove it\n  " + line);
  // On stderr, unwrapped (Catch wraps its messages at 80 columns): rows to paste.
  for (const std::string& p : problems) std::cerr << file.string() << ": " << p << "\n";
  INFO(problems.size() << " key(s) of docs/recipes.md to fix: each is printed in full above");
  CHECK(problems.empty());
}

TEST_CASE("docs: the process-word check catches development wording, not product words", "[docs]") {
  CHECK(process_marker_hits("t", {"Session 4, same VM"}).size() == 1);
  CHECK(process_marker_hits("t", {"measured in sessions 1-3"}).size() == 1);
  CHECK(process_marker_hits("t", {"Profiling notes from this session"}).size() == 1);
  CHECK(process_marker_hits("t", {"see issue #12"}).size() == 1);
  CHECK(process_marker_hits("t", {"so the goal is not yet met"}).size() == 1);
  CHECK(process_marker_hits("t", {"at the 90% goal in 2 of 7"}).size() == 1);
  CHECK(process_marker_hits("t", {"No GPU was available to us"}).size() == 1);
  CHECK(process_marker_hits("t", {"the table needs re-measuring"}).size() == 1);
  CHECK(process_marker_hits("t", {"come with the next issues"}).size() == 1);
  // The name spelled in two parts, so that no line of the code base cites it.
  CHECK(process_marker_hits("t", {std::string("[design](../shared/DESIGN") + ".md)"}).size() == 1);
  CHECK(process_marker_hits("t", {"`trainer/session.cpp` owns a training session's state",
                                  "bench_dp --rounds 5: five alternated rounds",
                                  "Known issues and limits", "a tuning session of the user"})
            .empty());
}

TEST_CASE("docs: README.md and docs/ speak of the product, not of how it was developed", "[docs]") {
  std::vector<std::string> hits;
  for (const fs::path& file : documents()) {
    auto found = process_marker_hits(fs::relative(file, kSource).string(), lines_of(file));
    hits.insert(hits.end(), found.begin(), found.end());
  }
  for (const std::string& h : hits) UNSCOPED_INFO(h);
  CHECK(hits.empty());
}

TEST_CASE("docs: relative links of README.md and docs/ point at files of the repository",
          "[docs]") {
  const std::regex link(R"(\]\(([^)#\s]+)(#[^)]*)?\))");
  std::vector<std::string> broken;
  const fs::path root = fs::weakly_canonical(kSource);
  for (const fs::path& file : documents()) {
    const std::vector<std::string> lines = lines_of(file);
    for (size_t i = 0; i < lines.size(); ++i)
      for (std::sregex_iterator m(lines[i].begin(), lines[i].end(), link), end; m != end; ++m) {
        const std::string target = (*m)[1];
        if (target.find("://") != std::string::npos || target.rfind("mailto:", 0) == 0) continue;
        const fs::path resolved = fs::weakly_canonical(file.parent_path() / target);
        const std::string where =
            fs::relative(file, kSource).string() + ":" + std::to_string(i + 1);
        if (resolved.string().rfind(root.string() + "/", 0) != 0)
          broken.push_back(where + ": '" + target + "' is outside the repository");
        else if (!fs::exists(resolved))
          broken.push_back(where + ": '" + target + "' does not exist");
      }
  }
  for (const std::string& b : broken) UNSCOPED_INFO(b);
  CHECK(broken.empty());
}
