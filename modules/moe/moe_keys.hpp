// The deck section [moe]: mixture of experts (MODEL.md section 3), declared and checked next
// to the layer that reads it.
#pragma once

#include "io/deck_schema.hpp"

namespace kmoe {

deck::DeckSection moe_deck_section();  // [moe]

}  // namespace kmoe
