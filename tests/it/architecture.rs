//! The architecture check: no import cycles between modules, and every import follows the
//! layer order written in `ARCHITECTURE.md` (section `## Layers`).
//!
//! How the code is read, with no parser crate:
//!
//! - Every `.rs` file under `src/` but `main.rs` is a module: `src/a.rs` and `src/a/mod.rs` are
//!   `a`, `src/a/b.rs` is `a::b`; `src/lib.rs` is the crate root, which is no node. The crates
//!   under `crates/` are read the same way into the same namespace (`CRATES`); imports from one
//!   crate to another are Cargo's to check, so only imports within a crate are edges.
//! - Comments and the insides of string and char literals are blanked (line breaks kept, so
//!   line numbers stay right); what is left is cut into identifiers and punctuation.
//! - A reference is a `use` tree (grouped, nested, over several lines) or an inline path
//!   anywhere in code, that starts with `crate`, `super` or `self` (`$crate` too). Relative
//!   paths are resolved against the module they are written in, inline `mod tests { … }`
//!   included: `#[cfg(test)]` code is part of its file and checked like the rest, so a test
//!   cannot reach into a layer the code itself may not.
//! - A path stands for the deepest module it names that exists as a file:
//!   `crate::store::admin::TtlRecord` is `store::admin` when `src/store/admin.rs` exists.
//!
//! The graph: an import between a module and its own ancestor or descendant is not counted
//! (`pipeline` ↔ `pipeline::plan`). Seen from outside, a folder is one unit: an import from
//! `a::x` to `b::y` is an edge `a → b` between the two siblings under the modules' common
//! ancestor, so `summary → pipeline::recall` and `pipeline::summary → summary` make the cycle
//! `pipeline, summary` even though no single file is on both sides. Every strongly connected
//! component with more than one module is reported as a cycle.
//!
//! The layers: a table `| N | name | modules |` from the edge (1) down to the leaves; a listed
//! module covers its descendants unless a descendant is listed itself. An import from a module
//! to one in a higher layer (smaller N) is against the order, allowed only when listed under
//! `### Imports against the order` as ``- `from` → `to`: reason`` (at most three; a listed
//! exception covers imports from `from` or its descendants to `to` or its descendants, and one
//! that covers none is stale).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::Path;

/// Exceptions to the layer order allowed at most.
const MAX_EXCEPTIONS: usize = 3;

/// One source file: its path as shown in reports, its module (`a::b`; the root is ""), its text.
struct SourceFile {
    path: String,
    module: String,
    text: String,
}

/// Where an import comes from: the file and line of the first reference that makes it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Witness {
    path: String,
    line: usize,
}

/// The modules and the imports between them.
struct Graph {
    /// Every module that is a file, the root excluded.
    modules: BTreeSet<String>,
    /// File module → file module, neither the ancestor of the other.
    edges: BTreeMap<(String, String), Witness>,
}

/// An edge between two sibling modules, and the file-level import that makes it.
struct LiftedEdge {
    from: String,
    to: String,
    witness: Witness,
}

// ---------------------------------------------------------------------------------------------
// Reading the files
// ---------------------------------------------------------------------------------------------

/// The module of a file given by its path relative to `src/`; `None` for `main.rs` and for
/// files that are not Rust.
fn module_of(relative: &str) -> Option<String> {
    let relative = relative.replace('\\', "/");
    let stem = relative.strip_suffix(".rs")?;
    if stem == "main" {
        return None;
    }
    if stem == "lib" {
        return Some(String::new());
    }
    let stem = stem.strip_suffix("/mod").unwrap_or(stem);
    Some(stem.replace('/', "::"))
}

/// Every `.rs` file under `dir`, sorted by path, as (path relative to `dir`, text).
fn read_tree(dir: &Path) -> std::io::Result<Vec<(String, String)>> {
    let mut pending = vec![dir.to_path_buf()];
    let mut files = Vec::new();
    while let Some(folder) = pending.pop() {
        for entry in std::fs::read_dir(&folder)? {
            let path = entry?.path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let relative = path.strip_prefix(dir).unwrap_or(&path);
                let relative = relative.to_string_lossy().replace('\\', "/");
                files.push((relative, std::fs::read_to_string(&path)?));
            }
        }
    }
    files.sort();
    Ok(files)
}

/// The source files of a crate, from (path relative to `src/`, text) pairs.
fn source_files(files: Vec<(String, String)>) -> Vec<SourceFile> {
    files
        .into_iter()
        .filter_map(|(relative, text)| {
            let module = module_of(&relative)?;
            Some(SourceFile {
                path: format!("src/{relative}"),
                module,
                text,
            })
        })
        .collect()
}

fn is_ident_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The text with comments and the insides of string and char literals replaced by spaces; line
/// breaks are kept so positions keep their line numbers.
fn blank_comments_and_literals(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    let at = |i: usize| chars.get(i).copied();
    let mut i = 0;
    while let Some(c) = at(i) {
        if c == '/' && at(i + 1) == Some('/') {
            while let Some(c) = at(i).filter(|&c| c != '\n') {
                out.push(blank(c));
                i += 1;
            }
        } else if c == '/' && at(i + 1) == Some('*') {
            // Block comments nest.
            let mut depth = 0;
            while let Some(c) = at(i) {
                if c == '/' && at(i + 1) == Some('*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if c == '*' && at(i + 1) == Some('/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(c));
                    i += 1;
                }
            }
        } else if let Some(hashes) = raw_string_start(&chars, i) {
            // r"…", r#"…"#, br"…", cr"…": no escapes; ends at a quote followed by the hashes.
            let open = 1 + hashes + 1;
            out.extend(std::iter::repeat_n(' ', open));
            i += open;
            while let Some(c) = at(i) {
                let closes = c == '"' && (1..=hashes).all(|k| at(i + k) == Some('#'));
                if closes {
                    out.extend(std::iter::repeat_n(' ', 1 + hashes));
                    i += 1 + hashes;
                    break;
                }
                out.push(blank(c));
                i += 1;
            }
        } else if c == '"' {
            out.push(' ');
            i += 1;
            while let Some(c) = at(i) {
                out.push(blank(c));
                i += 1;
                if c == '\\' {
                    if let Some(escaped) = at(i) {
                        out.push(blank(escaped));
                        i += 1;
                    }
                } else if c == '"' {
                    break;
                }
            }
        } else if c == '\'' {
            // A char literal ('x', '\n', '\u{1F600}', '"') is blanked; a lifetime or a label
            // ('a, 'outer) is kept.
            let end = if at(i + 1) == Some('\\') {
                (i + 3..chars.len()).find(|&j| chars[j] == '\'')
            } else if at(i + 2) == Some('\'') {
                Some(i + 2)
            } else {
                None
            };
            match end {
                Some(end) => {
                    out.extend(std::iter::repeat_n(' ', end + 1 - i));
                    i = end + 1;
                }
                None => {
                    out.push(c);
                    i += 1;
                }
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// At the `r` of a raw string (`r"`, `r#"`, `br"`, `cr"`), the number of its `#`s.
fn raw_string_start(chars: &[char], i: usize) -> Option<usize> {
    if chars.get(i) != Some(&'r') {
        return None;
    }
    let before = |k: usize| i.checked_sub(k).and_then(|j| chars.get(j)).copied();
    let starts_word = match before(1) {
        None => true,
        Some('b' | 'c') => before(2).is_none_or(|c| !is_ident_char(c)),
        Some(c) => !is_ident_char(c),
    };
    if !starts_word {
        return None;
    }
    let hashes = chars[i + 1..].iter().take_while(|&&c| c == '#').count();
    (chars.get(i + 1 + hashes) == Some(&'"')).then_some(hashes)
}

/// An identifier, `::`, or one punctuation character, with its line.
#[derive(Debug)]
struct Token {
    text: String,
    line: usize,
}

fn tokenize(code: &str) -> Vec<Token> {
    let chars: Vec<char> = code.chars().collect();
    let mut tokens = Vec::new();
    let mut line = 1;
    let mut i = 0;
    while let Some(&c) = chars.get(i) {
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if is_ident_char(c) {
            let start = i;
            while chars.get(i).is_some_and(|&c| is_ident_char(c)) {
                i += 1;
            }
            tokens.push(Token {
                text: chars[start..i].iter().collect(),
                line,
            });
        } else if c == ':' && chars.get(i + 1) == Some(&':') {
            tokens.push(Token {
                text: "::".to_string(),
                line,
            });
            i += 2;
        } else {
            tokens.push(Token {
                text: c.to_string(),
                line,
            });
            i += 1;
        }
    }
    tokens
}

fn is_ident(text: &str) -> bool {
    text.chars().next().is_some_and(is_ident_char)
}

/// A path as written (`crate::a::B`, `super::x`), with its line.
struct WrittenPath {
    segments: Vec<String>,
    line: usize,
}

/// Every path a file writes that starts with `crate`, `super` or `self`, each resolved to
/// absolute segments (without `crate`) against the module it is written in: the file's module
/// plus any inline `mod name { … }` around it.
fn references(text: &str, file_module: &str) -> Vec<(Vec<String>, usize)> {
    let tokens = tokenize(&blank_comments_and_literals(text));
    let text_at = |i: usize| tokens.get(i).map_or("", |t| t.text.as_str());
    let base: Vec<String> = file_module
        .split("::")
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect();
    // Inline modules around the current token: (name, brace depth inside its body).
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0;
    let mut found = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let mut written = Vec::new();
        match text_at(i) {
            "{" => {
                depth += 1;
                i += 1;
            }
            "}" => {
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
                i += 1;
            }
            // The body's `{` comes next and opens at `depth + 1`.
            "mod" if is_ident(text_at(i + 1)) && text_at(i + 2) == "{" => {
                inline.push((text_at(i + 1).to_string(), depth + 1));
                i += 2;
            }
            // `use<'a>` is a precise-capturing bound, not an import.
            "use" if text_at(i + 1) != "<" => {
                let mut pos = i + 1;
                use_tree(&tokens, &mut pos, &mut Vec::new(), &mut written);
                i = pos;
            }
            "crate" | "super" | "self"
                if text_at(i + 1) == "::" && (i == 0 || text_at(i - 1) != "::") =>
            {
                let mut segments = vec![text_at(i).to_string()];
                let mut j = i + 1;
                while text_at(j) == "::" && is_ident(text_at(j + 1)) {
                    segments.push(text_at(j + 1).to_string());
                    j += 2;
                }
                written.push(WrittenPath {
                    segments,
                    line: tokens[i].line,
                });
                i = j;
            }
            _ => i += 1,
        }
        if written.is_empty() {
            continue;
        }
        let current: Vec<String> = base
            .iter()
            .cloned()
            .chain(inline.iter().map(|(name, _)| name.clone()))
            .collect();
        for path in written {
            if let Some(absolute) = absolute_path(&path.segments, &current) {
                found.push((absolute, path.line));
            }
        }
    }
    found
}

/// Reads one `use` tree from `tokens[*pos]`, pushing every full path it names onto `out`.
fn use_tree(
    tokens: &[Token],
    pos: &mut usize,
    prefix: &mut Vec<String>,
    out: &mut Vec<WrittenPath>,
) {
    let text_at = |i: usize| tokens.get(i).map_or("", |t| t.text.as_str());
    let line = tokens.get(*pos).map_or(0, |t| t.line);
    let outer = prefix.len();
    loop {
        match text_at(*pos) {
            "::" => *pos += 1,
            "{" => {
                *pos += 1;
                while !matches!(text_at(*pos), "}" | "" | ";") {
                    let before = *pos;
                    use_tree(tokens, pos, prefix, out);
                    if text_at(*pos) == "," {
                        *pos += 1;
                    }
                    if *pos == before {
                        break;
                    }
                }
                if text_at(*pos) == "}" {
                    *pos += 1;
                }
                break;
            }
            "*" => {
                *pos += 1;
                out.push(WrittenPath {
                    segments: prefix.clone(),
                    line,
                });
                break;
            }
            name if is_ident(name) => {
                prefix.push(name.to_string());
                *pos += 1;
                if text_at(*pos) == "::" {
                    continue;
                }
                if text_at(*pos) == "as" {
                    *pos += 2;
                }
                out.push(WrittenPath {
                    segments: prefix.clone(),
                    line,
                });
                break;
            }
            _ => break,
        }
    }
    prefix.truncate(outer);
}

/// A written path made absolute (segments after `crate`), or `None` when it does not start with
/// `crate`, `super` or `self` or climbs above the root.
fn absolute_path(segments: &[String], current: &[String]) -> Option<Vec<String>> {
    let (first, rest) = segments.split_first()?;
    let mut absolute = match first.as_str() {
        "crate" => Vec::new(),
        "self" => current.to_vec(),
        "super" => current.split_last()?.1.to_vec(),
        _ => return None,
    };
    for segment in rest {
        match segment.as_str() {
            "super" => {
                absolute.pop()?;
            }
            "self" => {}
            name => absolute.push(name.to_string()),
        }
    }
    Some(absolute)
}

/// The deepest module of `modules` that `absolute` names; `None` for the root.
fn deepest_module(absolute: &[String], modules: &BTreeSet<String>) -> Option<String> {
    (1..=absolute.len())
        .rev()
        .map(|n| absolute[..n].join("::"))
        .find(|candidate| modules.contains(candidate))
}

/// Whether `a` is `b`, or an ancestor or descendant of it.
fn related(a: &str, b: &str) -> bool {
    a == b || is_within(a, b) || is_within(b, a)
}

/// Whether `module` is `outer` or one of its descendants.
fn is_within(module: &str, outer: &str) -> bool {
    module == outer
        || module
            .strip_prefix(outer)
            .is_some_and(|rest| rest.starts_with("::"))
}

fn build_graph(files: &[SourceFile]) -> Graph {
    let modules: BTreeSet<String> = files
        .iter()
        .map(|f| f.module.clone())
        .filter(|m| !m.is_empty())
        .collect();
    let mut edges = BTreeMap::new();
    for file in files.iter().filter(|f| !f.module.is_empty()) {
        for (absolute, line) in references(&file.text, &file.module) {
            let Some(target) = deepest_module(&absolute, &modules) else {
                continue;
            };
            if related(&file.module, &target) {
                continue;
            }
            edges
                .entry((file.module.clone(), target))
                .or_insert_with(|| Witness {
                    path: file.path.clone(),
                    line,
                });
        }
    }
    Graph { modules, edges }
}

// ---------------------------------------------------------------------------------------------
// Cycles
// ---------------------------------------------------------------------------------------------

/// Each file-level edge as an edge between the two siblings under the modules' common ancestor
/// (the first reference found for each).
fn lifted_edges(graph: &Graph) -> Vec<LiftedEdge> {
    let mut lifted: BTreeMap<(String, String), Witness> = BTreeMap::new();
    for ((from, to), witness) in &graph.edges {
        let from_segments: Vec<&str> = from.split("::").collect();
        let to_segments: Vec<&str> = to.split("::").collect();
        let common = from_segments
            .iter()
            .zip(&to_segments)
            .take_while(|(a, b)| a == b)
            .count();
        // Neither is the other's ancestor, so both are longer than the common part.
        let key = (
            from_segments[..=common].join("::"),
            to_segments[..=common].join("::"),
        );
        lifted.entry(key).or_insert_with(|| witness.clone());
    }
    lifted
        .into_iter()
        .map(|((from, to), witness)| LiftedEdge { from, to, witness })
        .collect()
}

/// The strongly connected components with more than one node (Tarjan), each sorted.
fn cycles(edges: &[LiftedEdge]) -> Vec<Vec<String>> {
    let mut next: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for edge in edges {
        next.entry(&edge.from).or_default().push(&edge.to);
        next.entry(&edge.to).or_default();
    }
    struct Tarjan<'a> {
        next: &'a BTreeMap<&'a str, Vec<&'a str>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        components: Vec<Vec<String>>,
    }
    impl<'a> Tarjan<'a> {
        fn visit(&mut self, node: &'a str) {
            let n = self.index.len();
            self.index.insert(node, n);
            self.low.insert(node, n);
            self.stack.push(node);
            self.on_stack.insert(node);
            for &to in self.next.get(node).into_iter().flatten() {
                if !self.index.contains_key(to) {
                    self.visit(to);
                    let low = self.low[node].min(self.low[to]);
                    self.low.insert(node, low);
                } else if self.on_stack.contains(to) {
                    let low = self.low[node].min(self.index[to]);
                    self.low.insert(node, low);
                }
            }
            if self.low[node] == self.index[node] {
                let mut component = Vec::new();
                while let Some(top) = self.stack.pop() {
                    self.on_stack.remove(top);
                    component.push(top.to_string());
                    if top == node {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort();
                    self.components.push(component);
                }
            }
        }
    }
    let mut tarjan = Tarjan {
        next: &next,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        components: Vec::new(),
    };
    for &node in next.keys() {
        if !tarjan.index.contains_key(node) {
            tarjan.visit(node);
        }
    }
    tarjan.components.sort();
    tarjan.components
}

/// The cycle report: each cycle and, per edge inside it, the reference that makes it. Empty
/// when there is no cycle.
fn cycle_report(graph: &Graph) -> String {
    let edges = lifted_edges(graph);
    let mut report = String::new();
    for component in cycles(&edges) {
        let _ = writeln!(report, "cycle: {}", component.join(", "));
        for edge in edges
            .iter()
            .filter(|e| component.contains(&e.from) && component.contains(&e.to))
        {
            let _ = writeln!(
                report,
                "  {} -> {}    {}:{}",
                edge.from, edge.to, edge.witness.path, edge.witness.line
            );
        }
    }
    report
}

// ---------------------------------------------------------------------------------------------
// Layers
// ---------------------------------------------------------------------------------------------

#[derive(Debug)]
struct LayerRow {
    number: usize,
    name: String,
    modules: Vec<String>,
}

#[derive(Debug)]
struct Exception {
    from: String,
    to: String,
}

#[derive(Debug)]
struct Layers {
    rows: Vec<LayerRow>,
    exceptions: Vec<Exception>,
}

/// The backticked items of a piece of Markdown, in order.
fn backticked(text: &str) -> Vec<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .map(|s| s.trim().to_string())
        .collect()
}

/// Reads `## Layers` of ARCHITECTURE.md: the table, and the bullets under
/// `### Imports against the order`.
fn parse_layers(markdown: &str) -> Result<Layers, String> {
    let mut lines = markdown
        .lines()
        .skip_while(|line| line.trim_end() != "## Layers");
    if lines.next().is_none() {
        return Err("ARCHITECTURE.md has no `## Layers` section".to_string());
    }
    let section: Vec<&str> = lines.take_while(|line| !line.starts_with("## ")).collect();
    let mut rows = Vec::new();
    let mut exceptions = Vec::new();
    let mut in_exceptions = false;
    for line in section {
        let line = line.trim();
        if let Some(heading) = line.strip_prefix("### ") {
            in_exceptions = heading.trim() == "Imports against the order";
        } else if line.starts_with('|') && !in_exceptions {
            let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
            let Ok(number) = cells[0].parse::<usize>() else {
                continue; // the header and the separator row
            };
            if cells.len() != 3 {
                return Err(format!("a layer row needs 3 cells: {line}"));
            }
            rows.push(LayerRow {
                number,
                name: cells[1].to_string(),
                modules: backticked(cells[2]),
            });
        } else if in_exceptions && (line.starts_with("- ") || line.starts_with("* ")) {
            let (pair, reason) = line.split_once("`:").unwrap_or((line, ""));
            let ends = backticked(&format!("{pair}`"));
            let arrow = pair.contains('→') || pair.contains("->");
            match ends.as_slice() {
                [from, to] if arrow && !reason.trim().is_empty() => exceptions.push(Exception {
                    from: from.clone(),
                    to: to.clone(),
                }),
                _ => {
                    return Err(format!(
                        "an exception must read ``- `from` → `to`: reason``: {line}"
                    ));
                }
            }
        }
    }
    if rows.is_empty() {
        return Err("`## Layers` has no table rows `| N | name | modules |`".to_string());
    }
    Ok(Layers { rows, exceptions })
}

impl Layers {
    /// The layer of a module: that of the most specific listed module covering it.
    fn layer_of(&self, module: &str) -> Option<&LayerRow> {
        self.rows
            .iter()
            .flat_map(|row| row.modules.iter().map(move |listed| (listed, row)))
            .filter(|(listed, _)| is_within(module, listed))
            .max_by_key(|(listed, _)| listed.len())
            .map(|(_, row)| row)
    }
}

/// Every way the graph breaks the layers: modules the table names that do not exist, modules
/// it does not cover, imports against the order not listed, too many or stale exceptions.
fn layer_problems(layers: &Layers, graph: &Graph) -> Vec<String> {
    let mut problems = Vec::new();
    let mut listed = BTreeSet::new();
    for row in &layers.rows {
        for module in &row.modules {
            if !graph.modules.contains(module) {
                problems.push(format!(
                    "layer {} ({}) names a module that does not exist: `{module}`",
                    row.number, row.name
                ));
            }
            if !listed.insert(module) {
                problems.push(format!("`{module}` is listed in more than one row"));
            }
        }
    }
    let uncovered: Vec<&str> = graph
        .modules
        .iter()
        .filter(|m| layers.layer_of(m).is_none())
        .map(String::as_str)
        .collect();
    if !uncovered.is_empty() {
        problems.push(format!(
            "modules in no layer: {}",
            uncovered
                .iter()
                .map(|m| format!("`{m}`"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    if layers.exceptions.len() > MAX_EXCEPTIONS {
        problems.push(format!(
            "{} imports against the order are listed; at most {MAX_EXCEPTIONS} are allowed",
            layers.exceptions.len()
        ));
    }
    let mut used = vec![false; layers.exceptions.len()];
    for ((from, to), witness) in &graph.edges {
        let (Some(from_layer), Some(to_layer)) = (layers.layer_of(from), layers.layer_of(to))
        else {
            continue;
        };
        if to_layer.number >= from_layer.number {
            continue;
        }
        let exception = layers
            .exceptions
            .iter()
            .position(|e| is_within(from, &e.from) && is_within(to, &e.to));
        match exception {
            Some(k) => used[k] = true,
            None => problems.push(format!(
                "import against the order: {from} ({} {}) -> {to} ({} {})    {}:{}",
                from_layer.number,
                from_layer.name,
                to_layer.number,
                to_layer.name,
                witness.path,
                witness.line
            )),
        }
    }
    for (exception, used) in layers.exceptions.iter().zip(used) {
        if !used {
            problems.push(format!(
                "stale exception: no import against the order from `{}` to `{}`",
                exception.from, exception.to
            ));
        }
    }
    problems
}

// ---------------------------------------------------------------------------------------------
// The checks of the real crate
// ---------------------------------------------------------------------------------------------

/// The workspace's crates, each with the module its root is in the one namespace of the layers
/// table: the edge (`src/`), `memproxy-base` and `memproxy-core` hold top-level modules, and
/// `memproxy-store` is `store` (the edge re-exports it under that name).
const CRATES: [(&str, &str); 5] = [
    ("src", ""),
    ("crates/base/src", ""),
    ("crates/core/src", ""),
    ("crates/store/src", "store"),
    ("crates/embed/src", "embed"),
];

/// The graph of the workspace's modules. An import between crates (`memproxy_store::…` in
/// `memproxy-core`) is no edge: Cargo already refuses one against the order of the crates, so
/// what is checked here is the order within each crate, and the edge's imports of the crates
/// below through their re-exported names (`crate::store::…`).
fn crate_graph() -> std::io::Result<Graph> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for (dir, prefix) in CRATES {
        for (relative, text) in read_tree(&root.join(dir))? {
            let Some(module) = module_of(&relative) else {
                continue;
            };
            let (module, text) = if prefix.is_empty() {
                (module, text)
            } else if module.is_empty() {
                (
                    prefix.to_string(),
                    text.replace("crate::", &format!("crate::{prefix}::")),
                )
            } else {
                let text = text.replace("crate::", &format!("crate::{prefix}::"));
                (format!("{prefix}::{module}"), text)
            };
            files.push(SourceFile {
                path: format!("{dir}/{relative}"),
                module,
                text,
            });
        }
    }
    Ok(build_graph(&files))
}

#[test]
fn the_crate_is_read_in_full() {
    let graph = crate_graph().unwrap();
    assert!(
        graph.modules.len() > 30,
        "only {} modules found under src/",
        graph.modules.len()
    );
    assert!(
        graph.edges.len() > 40,
        "only {} imports between modules found: is the parser reading anything?",
        graph.edges.len()
    );
}

#[test]
fn modules_import_each_other_without_cycles() {
    let report = cycle_report(&crate_graph().unwrap());
    assert!(
        report.is_empty(),
        "import cycles between modules (a folder counts as one module seen from outside):\n{report}"
    );
}

#[test]
fn imports_follow_the_layers_of_architecture_md() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("ARCHITECTURE.md");
    let markdown = std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("{err}"));
    let layers = parse_layers(&markdown).unwrap_or_else(|err| panic!("{err}"));
    let problems = layer_problems(&layers, &crate_graph().unwrap());
    assert!(
        problems.is_empty(),
        "ARCHITECTURE.md `## Layers` does not hold:\n  - {}",
        problems.join("\n  - ")
    );
}

// ---------------------------------------------------------------------------------------------
// The checker's own tests, on small made-up crates
// ---------------------------------------------------------------------------------------------

mod checker {
    use super::*;

    fn graph(files: &[(&str, &str)]) -> Graph {
        build_graph(&source_files(
            files
                .iter()
                .map(|(path, text)| (path.to_string(), text.to_string()))
                .collect(),
        ))
    }

    /// The edges as `from -> to` strings.
    fn edges(files: &[(&str, &str)]) -> Vec<String> {
        graph(files)
            .edges
            .keys()
            .map(|(from, to)| format!("{from} -> {to}"))
            .collect()
    }

    const LEAVES: [(&str, &str); 4] = [("a.rs", ""), ("b.rs", ""), ("c.rs", ""), ("d.rs", "")];

    fn with_leaves<'a>(files: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
        LEAVES.iter().chain(files).copied().collect()
    }

    #[test]
    fn files_map_to_modules() {
        assert_eq!(module_of("a.rs").as_deref(), Some("a"));
        assert_eq!(module_of("a/mod.rs").as_deref(), Some("a"));
        assert_eq!(module_of("a/b.rs").as_deref(), Some("a::b"));
        assert_eq!(module_of("lib.rs").as_deref(), Some(""));
        assert_eq!(module_of("main.rs"), None);
        assert_eq!(module_of("notes.md"), None);
    }

    #[test]
    fn grouped_uses_over_several_lines_name_each_module() {
        let found = edges(&with_leaves(&[(
            "x.rs",
            "use crate::{\n    a::X,\n    b::{self, Y as Z},\n    c::*,\n};\nuse std::fmt;\n",
        )]));
        assert_eq!(found, ["x -> a", "x -> b", "x -> c"]);
        let graph = graph(&with_leaves(&[(
            "x.rs",
            "use crate::{\n    a::X,\n    b::{self, Y as Z},\n};\n",
        )]));
        let line = |to: &str| graph.edges[&("x".to_string(), to.to_string())].line;
        assert_eq!((line("a"), line("b")), (2, 3));
    }

    #[test]
    fn inline_paths_count_anywhere_in_code() {
        let text = "fn f() -> crate::a::T { let x = crate::b::make::<u8>(); $crate::c::g() }\n\
                    pub(crate) fn h() {}\npub(super) fn i() {}\n";
        assert_eq!(
            edges(&with_leaves(&[("x.rs", text)])),
            ["x -> a", "x -> b", "x -> c"]
        );
    }

    #[test]
    fn relative_paths_resolve_against_the_module_they_are_in() {
        let files = with_leaves(&[
            ("p/mod.rs", "mod q;\nmod r;\n"),
            ("p/r.rs", ""),
            (
                "p/q.rs",
                "use super::r::Z;\nuse super::super::a::X;\nfn f() { self::g(); super::super::b::h(); }\n\
                 #[cfg(test)]\nmod tests {\n    use super::*;\n    use super::super::super::c::Y;\n}\n\
                 fn after() { super::super::d::k(); }\n",
            ),
        ]);
        assert_eq!(
            edges(&files),
            [
                "p::q -> a",
                "p::q -> b",
                "p::q -> c",
                "p::q -> d",
                "p::q -> p::r"
            ]
        );
    }

    #[test]
    fn comments_and_string_literals_are_not_code() {
        let text = r####"
            // use crate::a::X;
            /// [`crate::a::Y`]
            //! crate::a
            /* crate::a /* nested crate::a */ crate::a */
            const S: &str = "crate::a::Z \" crate::a";
            const R: &str = r#"crate::a " crate::a"#;
            const B: &[u8] = br##"crate::a"##;
            const Q: char = '"';
            const E: char = '\'';
            fn f<'a>(x: &'a str) -> crate::b::T { 'outer: loop { break 'outer; } }
            use crate::c::U;
        "####;
        assert_eq!(edges(&with_leaves(&[("x.rs", text)])), ["x -> b", "x -> c"]);
    }

    #[test]
    fn a_precise_capturing_use_bound_is_not_an_import() {
        let text = "fn f<'a>(x: &'a u8) -> impl Sized + use<'a> { crate::a::g(x) }\n";
        assert_eq!(edges(&with_leaves(&[("x.rs", text)])), ["x -> a"]);
    }

    #[test]
    fn paths_name_the_deepest_module_that_is_a_file() {
        let files = [
            ("store/mod.rs", "pub mod admin;\n"),
            ("store/admin.rs", ""),
            (
                "x.rs",
                "use crate::store::admin::TtlRecord;\nuse crate::store::Store;\nfn f() { crate::lib_item(); }\n",
            ),
            ("y.rs", "use crate::store::Missing::Thing;\n"),
        ];
        assert_eq!(
            edges(&files),
            ["x -> store", "x -> store::admin", "y -> store"]
        );
    }

    #[test]
    fn imports_between_a_module_and_its_ancestors_are_not_edges() {
        let files = [
            (
                "store/mod.rs",
                "mod admin;\nuse crate::store::admin::X;\nuse self::admin::Y;\nuse admin::Z;\n",
            ),
            (
                "store/admin.rs",
                "use super::Store;\nuse crate::store::lock;\nuse crate::store;\n",
            ),
        ];
        assert!(edges(&files).is_empty());
    }

    #[test]
    fn a_three_cycle_is_found_and_what_hangs_off_it_is_not() {
        let graph = graph(&[
            ("a.rs", "use crate::b::X;\n"),
            ("b.rs", "use crate::c::X;\n"),
            ("c.rs", "use crate::a::X;\n"),
            ("d.rs", "use crate::a::X;\n"),
            ("e.rs", "use crate::d::X;\nuse crate::a::X;\n"),
        ]);
        assert_eq!(cycles(&lifted_edges(&graph)), [["a", "b", "c"]]);
        let report = cycle_report(&graph);
        assert!(report.starts_with("cycle: a, b, c\n"), "{report}");
        assert!(report.contains("  c -> a    src/c.rs:1"), "{report}");
        assert!(!report.contains("d ->"), "{report}");
    }

    #[test]
    fn a_folder_is_one_unit_seen_from_outside() {
        // No file is on both sides, but the folder `p` and `s` import each other.
        let graph = graph(&[
            ("p/mod.rs", "mod x;\nmod y;\n"),
            ("p/x.rs", "use crate::s::X;\n"),
            ("p/y.rs", ""),
            ("s.rs", "use crate::p::y::Y;\n"),
        ]);
        assert_eq!(cycles(&lifted_edges(&graph)), [["p", "s"]]);
        // Inside a folder, its files are the units.
        let graph = graph_with_sibling_cycle();
        assert_eq!(cycles(&lifted_edges(&graph)), [["p::x", "p::y"]]);
    }

    fn graph_with_sibling_cycle() -> Graph {
        graph(&[
            ("p/mod.rs", "mod x;\nmod y;\n"),
            ("p/x.rs", "use super::y::Y;\n"),
            ("p/y.rs", "use crate::p::x::X;\n"),
        ])
    }

    const TABLE: &str = "# Architecture\n\n## Layers\n\n\
        | N | layer | modules |\n|---|---|---|\n\
        | 1 | edge | `top` |\n\
        | 2 | middle | `mid`, `mid::low` |\n\
        | 3 | leaves | `low` |\n\n\
        ### Imports against the order\n\n";

    fn layered_crate() -> Graph {
        graph(&[
            ("top.rs", "use crate::mid::M;\nuse crate::low::L;\n"),
            ("mid/mod.rs", "mod low;\nmod deep;\n"),
            ("mid/low.rs", "use crate::low::L;\n"),
            ("mid/deep.rs", "use crate::low::L;\n"),
            ("low.rs", "fn f() { crate::mid::deep::g(); }\n"),
        ])
    }

    #[test]
    fn downward_imports_pass_and_upward_ones_are_named_with_file_and_line() {
        let layers = parse_layers(TABLE).unwrap();
        assert_eq!(layers.rows.len(), 3);
        // `mid::low` is listed itself, `mid::deep` falls under `mid`.
        assert_eq!(layers.layer_of("mid::deep").unwrap().number, 2);
        assert_eq!(layers.layer_of("low").unwrap().number, 3);
        let problems = layer_problems(&layers, &layered_crate());
        assert_eq!(
            problems,
            ["import against the order: low (3 leaves) -> mid::deep (2 middle)    src/low.rs:1"]
        );
    }

    #[test]
    fn a_listed_exception_allows_an_import_against_the_order() {
        for arrow in ["→", "->"] {
            let text = format!("{TABLE}- `low` {arrow} `mid`: the leaves call back for now.\n");
            let layers = parse_layers(&text).unwrap();
            assert!(layer_problems(&layers, &layered_crate()).is_empty());
        }
    }

    #[test]
    fn stale_and_too_many_exceptions_fail() {
        let text = format!(
            "{TABLE}- `low` → `mid`: one.\n- `mid` → `top`: two.\n- `low` → `top`: three.\n\
             - `mid::low` → `top`: four.\n\n## Next section\n- `a` → `b`: not read.\n"
        );
        let layers = parse_layers(&text).unwrap();
        assert_eq!(layers.exceptions.len(), 4);
        let problems = layer_problems(&layers, &layered_crate()).join("\n");
        assert!(
            problems.contains("4 imports against the order are listed"),
            "{problems}"
        );
        assert!(
            problems.contains("stale exception: no import against the order from `mid` to `top`")
        );
        assert!(problems.contains("from `low` to `top`"));
        assert!(!problems.contains("from `low` to `mid`"), "{problems}");
    }

    #[test]
    fn the_table_must_name_real_modules_and_cover_them_all() {
        let text = TABLE
            .replace("`low` |", "`low`, `ghost` |")
            .replace("`top`", "`top::x`");
        let problems = layer_problems(&parse_layers(&text).unwrap(), &layered_crate());
        assert!(
            problems.contains(
                &"layer 3 (leaves) names a module that does not exist: `ghost`".to_string()
            )
        );
        assert!(
            problems.contains(&"modules in no layer: `top`".to_string()),
            "{problems:?}"
        );
    }

    #[test]
    fn malformed_layer_text_is_an_error() {
        assert!(parse_layers("# Architecture\n").is_err());
        assert!(parse_layers("## Layers\n\nno table\n").is_err());
        let no_reason = format!("{TABLE}- `low` → `mid`\n");
        assert!(parse_layers(&no_reason).is_err());
    }
}

// ---------------------------------------------------------------------------------------------
// Module documentation that names files
// ---------------------------------------------------------------------------------------------

/// The `x.rs` names backticked in a file's `//!` documentation.
fn files_named_in_module_doc(text: &str) -> Vec<String> {
    let doc: String = text
        .lines()
        .take_while(|line| line.starts_with("//!") || line.trim().is_empty())
        .filter(|line| line.starts_with("//!"))
        .collect::<Vec<_>>()
        .join("\n");
    backticked(&doc)
        .into_iter()
        .filter(|name| {
            name.ends_with(".rs") && !name.contains(char::is_whitespace) && !name.contains("::")
        })
        .collect()
}

/// Module documentation goes stale when it names files: every file a module's documentation
/// in `src/` or `crates/` names exists (in the workspace), and a folder's `mod.rs` or `lib.rs`
/// that lists two or more files of its own folder lists them all.
#[test]
fn module_docs_name_files_that_exist_and_folder_lists_are_whole() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut everywhere = BTreeSet::new();
    let mut folders: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut docs = Vec::new();
    for dir in [
        "src",
        "crates",
        "tests/support",
        "tests/it",
        "examples",
        "benches",
    ] {
        if !root.join(dir).is_dir() {
            continue;
        }
        for (relative, text) in read_tree(&root.join(dir)).unwrap() {
            let path = format!("{dir}/{relative}");
            let (folder, name) = path.rsplit_once('/').unwrap();
            everywhere.insert(name.to_string());
            everywhere.insert(path.clone());
            folders
                .entry(folder.to_string())
                .or_default()
                .insert(name.to_string());
            if dir == "src" || dir == "crates" {
                docs.push((path, text));
            }
        }
    }
    // The integration tests themselves (their folder also holds the e2e clients' packages).
    for entry in std::fs::read_dir(root.join("tests")).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        if name.ends_with(".rs") {
            everywhere.insert(name.clone());
            everywhere.insert(format!("tests/{name}"));
        }
    }
    let mut problems = Vec::new();
    for (path, text) in &docs {
        let named = files_named_in_module_doc(text);
        for name in &named {
            let last = name.rsplit('/').next().unwrap_or(name);
            if !everywhere.contains(name.as_str()) && !everywhere.contains(last) {
                problems.push(format!("{path} names `{name}`, which does not exist"));
            }
        }
        let (folder, file) = path.rsplit_once('/').unwrap();
        if file != "mod.rs" && file != "lib.rs" {
            continue;
        }
        let siblings = &folders[folder];
        let listed = named
            .iter()
            .filter(|n| siblings.contains(n.as_str()))
            .count();
        if listed >= 2 {
            for sibling in siblings {
                if sibling != file && sibling != "main.rs" && !named.contains(sibling) {
                    problems.push(format!(
                        "{path} lists its folder's files but not `{sibling}`"
                    ));
                }
            }
        }
    }
    assert!(
        problems.is_empty(),
        "stale module documentation:\n  - {}",
        problems.join("\n  - ")
    );
}
