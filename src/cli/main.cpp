#include <cstdio>
int main() { std::puts("moe: under construction"); return 0; }
