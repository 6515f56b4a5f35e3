#include <gtest/gtest.h>
#include "base/dtype.h"
TEST(DType, Placeholder) { EXPECT_EQ(keel::bits(keel::DType::bf16), 16); }
