// The SequenceTable fuzzer's operation scripts (fuzz/sequence_script.hpp)
// under the ordinary test build, and so under the sanitizer build too: every
// committed seed in fuzz/corpus-sequences/ (each a regression input), and a
// batch of random scripts.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "../fuzz/sequence_script.hpp"

namespace {

namespace fs = std::filesystem;

fs::path corpus_dir() { return fs::path(__FILE__).parent_path().parent_path() / "fuzz" / "corpus-sequences"; }

std::vector<uint8_t> read_bytes(const fs::path& path) {
  std::ifstream file(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>()};
}

void run_or_fail(const std::vector<uint8_t>& bytes, const std::string& name) {
  try {
    pagedkv_fuzz::run_sequence_script(bytes.data(), bytes.size());
  } catch (const pagedkv_fuzz::Failure& failure) {
    ADD_FAILURE() << name << ": " << failure.what();
  }
}

TEST(FuzzSequencesCorpus, EverySeedPasses) {
  ASSERT_TRUE(fs::is_directory(corpus_dir())) << corpus_dir();
  int64_t n = 0;
  for (const auto& entry : fs::directory_iterator(corpus_dir())) {
    if (!entry.is_regular_file()) continue;
    run_or_fail(read_bytes(entry.path()), entry.path().filename().string());
    ++n;
  }
  EXPECT_GT(n, 0) << "no seeds in " << corpus_dir();
}

TEST(FuzzSequencesCorpus, RandomScriptsPass) {
  std::mt19937_64 rng(20240611);
  for (int i = 0; i < 200; ++i) {
    std::vector<uint8_t> bytes(64 + rng() % 1024);
    for (auto& b : bytes) b = static_cast<uint8_t>(rng());
    run_or_fail(bytes, "random script " + std::to_string(i));
  }
}

}  // namespace
