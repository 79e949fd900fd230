// Input deck (RUNTIME.md section 5): INI text read with Boost.Program_options, every key declared
// with type, default and help; command-line `--section.key=value` overrides; errors name the
// file, the key and its line.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/config.hpp"

namespace kmoe {

// Parses the deck file and the overrides (each "--section.key=value" or "section.key=value").
// Throws kmoe::Error naming the file, key and line for unknown keys, bad values, missing
// required keys and inconsistent combinations.
Config read_deck(const std::string& path, const std::vector<std::string>& overrides = {});

// Where a key the text sets came from, for error messages, when that is not the text itself
// (kmoe-import: "DIR/config.json: num_experts_per_tok = 9"); "" for a key located by its line.
using DeckSource = std::function<std::string(const std::string& key, const std::string& value)>;

// The same from deck text; `origin` names it in error messages (or `source`, per key).
Config parse_deck(const std::string& text, const std::string& origin,
                  const std::vector<std::string>& overrides = {}, const DeckSource& source = {});

// "section.key" -> value text of a resolved deck (Config::resolved_text), in file order.
// Used to compare a checkpoint's stored deck with the current one.
std::vector<std::pair<std::string, std::string>> resolved_values(const std::string& text);

// Help text listing every section, key, type, default and description.
std::string deck_help();

}  // namespace kmoe
