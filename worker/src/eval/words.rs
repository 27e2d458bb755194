//! Embedded English word lists for the synthetic tasks: needle keys (`adjective-noun`) and the common-words
//! vocabulary. Embedded rather than downloaded so that items are reproducible offline and identical everywhere.
//! Every word is lowercase ASCII, at least four letters long, and no word is a substring of another (across all
//! three lists), so that the case-insensitive substring scoring of RULER cannot credit one word for another.

/// Concrete nouns, whitespace-separated.
pub(crate) const NOUNS: &str = "\
    apple anchor angle animal ankle answer apron arrow attic autumn avenue badge pantry balloon bamboo \
    banana bandit banjo barrel basket beacon beaver bench berry bicycle blanket blossom bottle boulder \
    bracelet branch bread bridge brush bucket buffalo bundle butter button cabin cactus camera camel \
    canal candle canoe canyon carpet carrot castle cattle cellar chain chalk cherry chimney circus cliff \
    clock cloud coast cobweb coffee collar comet compass copper cottage cotton county coyote cradle \
    crayon cricket crystal cupboard curtain cushion daisy dentist desert diamond dinner doctor dolphin \
    donkey dragon drawer dream drum eagle elbow engine envelope eyebrow fabric falcon farmer feather \
    fence fiddle finger flame flute forest fountain frame garden garlic ginger giraffe glacier glove \
    goose grape gravel guitar hammer harbor harvest helmet hermit hollow honey hornet horse iceberg \
    island ivory jacket jaguar jelly jewel journal jungle kettle kitten ladder lagoon lantern lemon \
    leopard letter lettuce library lizard lobster locket magnet mango marble market meadow melon mirror \
    monkey morning mountain muffin museum needle noodle notebook ocean office olive onion orchard oyster \
    paddle palace panda parrot peach peanut pebble pencil pepper piano pigeon pillow pirate planet \
    pocket potato puzzle pyramid quilt rabbit radio raven ribbon river rocket saddle salmon sandal \
    satellite saucer scarf scissors shadow shelf shovel silver sister skate sketch sleeve slipper spider \
    sponge squirrel hayloft statue stone storm stove sugar summer sunset swamp sweater table teacher \
    temple tiger timber tomato tractor trumpet tulip tunnel turtle umbrella valley velvet village violin \
    volcano wagon walrus wallet walnut whale whistle window winter wizard wolf yogurt zebra meteor \
    nephew parcel quarry rooftop spindle thimble trolley tundra vessel wigwam bishop cobbler lighthouse \
    pasture rampart sawmill tavern vineyard windmill";

/// Adjectives, whitespace-separated.
pub(crate) const ADJECTIVES: &str = "\
    ancient angry bitter brave breezy bright brisk broken bumpy calm careful cheerful chilly clever \
    overcast clumsy cozy crisp crooked curious damp dazzling delicate dizzy dusty eager early elegant \
    empty fancy fierce flat fluffy foggy fragile frozen fuzzy gentle giant glossy golden graceful greedy \
    grumpy hasty heavy hazy honest humble hungry frosty jolly ripe lazy little lively lonely boisterous \
    lucky marvelous mellow messy mighty misty modern muddy slender nervous noisy orange pale patient \
    plain polite proud purple quick quiet rapid rare rigid rough round rusty sandy scarlet shaggy sharp \
    shiny silent silky drowsy slow smooth sneaky soft sour savory steep sticky gusty strange strict \
    sturdy sunny swift tall tame tender tidy tiny tired tough twisted vast violet warm wary weary wild \
    windy wise witty wooden yellow zealous";

/// Verbs, whitespace-separated.
pub(crate) const VERBS: &str = "\
    admire arrive bake balance bounce breathe build carry chase chew climb collect cook crawl dance \
    deliver burrow dive drift explore fetch float fold gather giggle glide grow hike hover hurry invent \
    juggle jump knit laugh lift listen march melt mend mumble nibble obey paint plant polish pour pull \
    push quack relax repair rescue roam scatter scribble shiver sing skip sleep slide sneeze sniff \
    splash sprint squeeze stir stretch swim swing tickle travel tumble twirl wander wave weave whisper \
    wiggle wobble wonder wrestle yawn";
