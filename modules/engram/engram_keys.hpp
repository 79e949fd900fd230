// The deck section [engram]: Engram conditional memory (MODEL.md section 4), declared and
// checked next to the layer that reads it.
#pragma once

#include "io/deck_schema.hpp"

namespace kmoe {

deck::DeckSection engram_deck_section();  // [engram]

}  // namespace kmoe
