//! The page's template language, a small subset of Mustache: the prose of
//! `benches/page.md` stays Markdown and the renderer fills in what the
//! records say.
//!
//! * `{{name}}`: the text of `name`. On a line of its own it is a block: the
//!   line becomes the text, and disappears when the text is empty.
//! * `{{#name}}` … `{{/name}}`: the part between, kept when `name` is on
//!   (a true flag, a non-empty text), or repeated once per item of a list,
//!   whose names it can then use; `{{^name}}` … `{{/name}}` keeps it when
//!   `name` is off (false, empty, an empty list). A line holding only such
//!   a tag disappears with the tag.
//!
//! A name that the fill does not have is an error, as is an unclosed or
//! mismatched section: the template and the renderer must agree.

use std::collections::BTreeMap;

/// What a name stands for.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Text(String),
    Flag(bool),
    /// Items, each with names of its own (looked up before the outer ones).
    List(Vec<Fill>),
}

/// The names a template is rendered with.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Fill(BTreeMap<&'static str, Value>);

impl Fill {
    pub fn new() -> Fill {
        Fill::default()
    }

    pub fn text(&mut self, name: &'static str, text: impl Into<String>) -> &mut Fill {
        self.0.insert(name, Value::Text(text.into()));
        self
    }

    pub fn flag(&mut self, name: &'static str, on: bool) -> &mut Fill {
        self.0.insert(name, Value::Flag(on));
        self
    }

    pub fn list(&mut self, name: &'static str, items: Vec<Fill>) -> &mut Fill {
        self.0.insert(name, Value::List(items));
        self
    }

    /// A section that holds once with `item`'s names, or not at all.
    pub fn item(&mut self, name: &'static str, item: Option<Fill>) -> &mut Fill {
        self.list(name, item.into_iter().collect())
    }
}

#[derive(Debug)]
enum Node {
    Text(String),
    /// A value; `block`: alone on its line.
    Value {
        name: String,
        block: bool,
    },
    Section {
        name: String,
        inverted: bool,
        body: Vec<Node>,
    },
}

#[derive(Debug)]
enum Tag<'a> {
    Value(&'a str),
    Open(&'a str, bool),
    Close(&'a str),
}

fn tag(inner: &str) -> Tag<'_> {
    let inner = inner.trim();
    if let Some(n) = inner.strip_prefix('#') {
        Tag::Open(n.trim(), false)
    } else if let Some(n) = inner.strip_prefix('^') {
        Tag::Open(n.trim(), true)
    } else if let Some(n) = inner.strip_prefix('/') {
        Tag::Close(n.trim())
    } else {
        Tag::Value(inner)
    }
}

/// The one tag of a line that holds nothing else.
fn alone(line: &str) -> Option<&str> {
    let t = line.trim();
    let inner = t.strip_prefix("{{")?.strip_suffix("}}")?;
    (!inner.contains("{{") && !inner.contains("}}")).then_some(inner)
}

fn parse(template: &str) -> Result<Vec<Node>, String> {
    // The open sections, innermost last: (name, inverted, the nodes before).
    let mut stack: Vec<(String, bool, Vec<Node>)> = Vec::new();
    let mut nodes: Vec<Node> = Vec::new();
    let mut apply = |t: Tag, block: bool, nodes: &mut Vec<Node>| -> Result<(), String> {
        match t {
            Tag::Value(n) => nodes.push(Node::Value {
                name: n.to_owned(),
                block,
            }),
            Tag::Open(n, inverted) => {
                stack.push((n.to_owned(), inverted, std::mem::take(nodes)));
            }
            Tag::Close(n) => {
                let Some((open, inverted, before)) = stack.pop() else {
                    return Err(format!("{{{{/{n}}}}} closes nothing"));
                };
                if open != n {
                    return Err(format!("{{{{/{n}}}}} closes {{{{#{open}}}}}"));
                }
                let body = std::mem::replace(nodes, before);
                nodes.push(Node::Section {
                    name: open,
                    inverted,
                    body,
                });
            }
        }
        Ok(())
    };
    for line in template.split_inclusive('\n') {
        if let Some(inner) = alone(line) {
            apply(tag(inner), true, &mut nodes)?;
            continue;
        }
        let mut rest = line;
        while let Some(start) = rest.find("{{") {
            let Some(len) = rest[start..].find("}}") else {
                return Err(format!("unclosed tag in {line:?}"));
            };
            if start > 0 {
                nodes.push(Node::Text(rest[..start].to_owned()));
            }
            apply(tag(&rest[start + 2..start + len]), false, &mut nodes)?;
            rest = &rest[start + len + 2..];
        }
        if !rest.is_empty() {
            nodes.push(Node::Text(rest.to_owned()));
        }
    }
    match stack.pop() {
        Some((open, _, _)) => Err(format!("{{{{#{open}}}}} is not closed")),
        None => Ok(nodes),
    }
}

fn lookup<'a>(scopes: &[&'a Fill], name: &str) -> Result<&'a Value, String> {
    scopes
        .iter()
        .rev()
        .find_map(|f| f.0.get(name))
        .ok_or_else(|| {
            format!("the page template uses {{{{{name}}}}}, which the renderer does not fill")
        })
}

fn walk(nodes: &[Node], scopes: &mut Vec<&Fill>, out: &mut String) -> Result<(), String> {
    for n in nodes {
        match n {
            Node::Text(t) => out.push_str(t),
            Node::Value { name, block } => match lookup(scopes, name)? {
                Value::Text(t) if *block => {
                    if !t.is_empty() {
                        out.push_str(t);
                        out.push('\n');
                    }
                }
                Value::Text(t) => out.push_str(t),
                _ => return Err(format!("{{{{{name}}}}} is a section, not a text")),
            },
            Node::Section {
                name,
                inverted,
                body,
            } => match lookup(scopes, name)? {
                Value::List(items) if !inverted => {
                    for item in items {
                        scopes.push(item);
                        let r = walk(body, scopes, out);
                        scopes.pop();
                        r?;
                    }
                }
                v => {
                    let on = match v {
                        Value::Text(t) => !t.is_empty(),
                        Value::Flag(b) => *b,
                        Value::List(items) => !items.is_empty(),
                    };
                    if on != *inverted {
                        walk(body, scopes, out)?;
                    }
                }
            },
        }
    }
    Ok(())
}

/// Render `template` with the names of `fill`.
pub fn render(template: &str, fill: &Fill) -> Result<String, String> {
    let nodes = parse(template)?;
    let mut out = String::with_capacity(template.len() * 2);
    walk(&nodes, &mut vec![fill], &mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_sections_and_lists() {
        let t = "# {{title}}\n\n{{#on}}\nshown {{x}}\n{{/on}}\n{{^on}}\nhidden\n{{/on}}\n\
                 {{#rows}}\n- {{name}} of {{title}}\n{{/rows}}\n{{^rows}}\nno rows\n{{/rows}}\nend\n";
        let mut f = Fill::new();
        f.text("title", "T").flag("on", true).text("x", "1");
        let mut a = Fill::new();
        a.text("name", "a");
        let mut b = Fill::new();
        b.text("name", "b");
        f.list("rows", vec![a, b]);
        assert_eq!(
            render(t, &f).expect("render"),
            "# T\n\nshown 1\n- a of T\n- b of T\nend\n"
        );
        f.flag("on", false).list("rows", Vec::new());
        assert_eq!(
            render(t, &f).expect("render"),
            "# T\n\nhidden\nno rows\nend\n"
        );
    }

    /// A value alone on its line is a block: it vanishes with its line
    /// when empty, so optional paragraphs leave no stray blank line.
    #[test]
    fn an_empty_block_takes_its_line_with_it() {
        let t = "## Summary\n\n{{lines}}\n\n## Next\n";
        let mut f = Fill::new();
        f.text("lines", "");
        assert_eq!(render(t, &f).expect("render"), "## Summary\n\n\n## Next\n");
        f.text("lines", "- one\n- two");
        assert_eq!(
            render(t, &f).expect("render"),
            "## Summary\n\n- one\n- two\n\n## Next\n"
        );
        // Inline, an empty value leaves the rest of its line.
        f.text("lines", "");
        assert_eq!(render("a{{lines}}b\n", &f).expect("render"), "ab\n");
    }

    #[test]
    fn mistakes_are_errors() {
        let empty = Fill::new();
        let mut flags = Fill::new();
        flags.flag("a", true).flag("b", true);
        for (template, f, want) in [
            ("{{nope}}\n", &empty, "{{nope}}"),
            ("{{#a}}\n", &empty, "not closed"),
            ("{{/a}}\n", &empty, "closes nothing"),
            ("{{#a}}{{/b}}\n", &flags, "closes"),
            ("{{a}}\n", &flags, "not a text"),
            ("x {{a\n", &flags, "unclosed"),
        ] {
            let e = render(template, f).expect_err(template);
            assert!(e.contains(want), "{template:?}: {e}");
        }
    }
}
