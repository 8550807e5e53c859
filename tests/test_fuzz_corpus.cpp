// The fuzzers' operation scripts under the ordinary test build, and so under
// the sanitizer build too: every committed seed (each a regression input)
// and a batch of random scripts, for both harnesses —
//   FuzzCorpus           PagedCache scripts (fuzz/script.hpp, fuzz/corpus/)
//   FuzzSequencesCorpus  SequenceTable scripts (fuzz/sequence_script.hpp,
//                        fuzz/corpus-sequences/)
//   FuzzPrefixCorpus     PrefixCache scripts (fuzz/prefix_script.hpp,
//                        fuzz/corpus-prefix/)
//   FuzzTiersCorpus      PrefixCache with host and disk tiers
//                        (fuzz/tier_script.hpp, fuzz/corpus-tiers/)
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "../fuzz/prefix_script.hpp"
#include "../fuzz/script.hpp"
#include "../fuzz/sequence_script.hpp"
#include "../fuzz/tier_script.hpp"

namespace {

namespace fs = std::filesystem;

/// One harness: where its seeds are and how it runs a script.
struct Harness {
  const char* corpus;  ///< folder under fuzz/
  void (*run)(const uint8_t* data, size_t size);
};

const Harness kPagedCache{"corpus", [](const uint8_t* d, size_t n) { pagedkv_fuzz::run_script(d, n); }};
const Harness kSequences{"corpus-sequences",
                         [](const uint8_t* d, size_t n) { pagedkv_fuzz::run_sequence_script(d, n); }};
const Harness kPrefix{"corpus-prefix", [](const uint8_t* d, size_t n) { pagedkv_fuzz::run_prefix_script(d, n); }};
const Harness kTiers{"corpus-tiers", [](const uint8_t* d, size_t n) { pagedkv_fuzz::run_tier_script(d, n); }};

std::vector<uint8_t> read_bytes(const fs::path& path) {
  std::ifstream file(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>()};
}

void run_or_fail(const Harness& harness, const std::vector<uint8_t>& bytes, const std::string& name) {
  try {
    harness.run(bytes.data(), bytes.size());
  } catch (const pagedkv_fuzz::Failure& failure) {
    ADD_FAILURE() << name << ": " << failure.what();
  }
}

void every_seed_passes(const Harness& harness) {
  const fs::path dir = fs::path(__FILE__).parent_path().parent_path() / "fuzz" / harness.corpus;
  ASSERT_TRUE(fs::is_directory(dir)) << dir;
  int64_t n = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    run_or_fail(harness, read_bytes(entry.path()), entry.path().filename().string());
    ++n;
  }
  EXPECT_GT(n, 0) << "no seeds in " << dir;
}

void random_scripts_pass(const Harness& harness, uint64_t seed, int n_scripts) {
  std::mt19937_64 rng(seed);
  for (int i = 0; i < n_scripts; ++i) {
    std::vector<uint8_t> bytes(64 + rng() % 1024);
    for (auto& b : bytes) b = static_cast<uint8_t>(rng());
    run_or_fail(harness, bytes, "random script " + std::to_string(i));
  }
}

TEST(FuzzCorpus, EverySeedPasses) { every_seed_passes(kPagedCache); }
TEST(FuzzCorpus, RandomScriptsPass) { random_scripts_pass(kPagedCache, 20240605, 300); }
TEST(FuzzSequencesCorpus, EverySeedPasses) { every_seed_passes(kSequences); }
TEST(FuzzSequencesCorpus, RandomScriptsPass) { random_scripts_pass(kSequences, 20240611, 200); }
TEST(FuzzPrefixCorpus, EverySeedPasses) { every_seed_passes(kPrefix); }
TEST(FuzzPrefixCorpus, RandomScriptsPass) { random_scripts_pass(kPrefix, 20261201, 200); }
// Random tier scripts run in tests/test_property.cpp (PrefixTiersProperty).
TEST(FuzzTiersCorpus, EverySeedPasses) { every_seed_passes(kTiers); }

}  // namespace
